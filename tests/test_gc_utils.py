"""The collector around start-up (gc_utils.py): paused while a process starts, left as the caller had it."""
import gc

import pytest

from pagedllm.gc_utils import freeze_gc_heap, gc_paused


@pytest.fixture(autouse=True)
def collector_restored():
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_paused_inside_and_enabled_again_after_even_when_the_body_raises():
    gc.enable()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("start-up failed")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_freeze_moves_the_survivors_out_of_reach_and_collects_again():
    gc.disable()
    survivor = [[] for _ in range(100)]
    freeze_gc_heap()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(survivor)
