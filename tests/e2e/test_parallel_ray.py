"""The Ray executor across machines, simulated on this one: a two-node Ray cluster on 127.0.0.1 (two CPUs a node),
the engine's ranks placed on both nodes by its placement group, greedy float32 output equal to transformers (tiny
models) and to one rank (SmolLM2, under chunked prefill and preemption)."""
from __future__ import annotations

import re

import psutil
import pytest

from pagedllm import SamplingParams
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.executor.multiproc import WorkerError
from tests.e2e.conftest import running_llm
from tests.e2e.parallel_helpers import wait_until
from tests.e2e.test_parallel_mp import STRESS, assert_same, expected, prompts, run  # noqa: F401 (fixtures)
from tests.e2e.test_parallel_tiny_models import assert_parity, generate, save_tiny_model

pytestmark = pytest.mark.ray

NODE = dict(num_cpus=2, object_store_memory=80 << 20)


@pytest.fixture(scope="module")
def ray():
    """The ray module, connected to a two-node cluster of its own. Imported here, not with the module: collecting
    the suite, which deselects these tests, would otherwise import Ray (seconds)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    cluster.add_node(**NODE)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield ray
    ray.shutdown()
    cluster.shutdown()


def engine_nodes(ray) -> set[str]:
    """The nodes the live engine's placement group put its ranks on."""
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1
    return set(groups[0]["bundles_to_node_id"].values())


def assert_tp2_pp2_across_the_nodes(ray, tmp_path, tokenizer) -> None:
    """A tiny model at tensor 2 x pipeline 2 matches transformers, its ranks placed on every node of the cluster."""
    reference = save_tiny_model(tmp_path, tokenizer, "qwen2")
    nodes = []
    got = generate(tmp_path, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray",
                   on_engine=lambda: nodes.append(engine_nodes(ray)))
    assert_parity(reference, got)
    assert nodes == [{node["NodeID"] for node in ray.nodes() if node["Alive"]}], "ranks not on both nodes"


def test_tiny_model_tp2_pp2_across_two_nodes(ray, tmp_path, tokenizer):
    assert_tp2_pp2_across_the_nodes(ray, tmp_path, tokenizer)


def test_an_engine_whose_caller_is_outside_ray_joins_the_cluster_of_ray_address(ray, tmp_path, tokenizer,
                                                                                monkeypatch):
    """`pagedllm serve` never joins a Ray cluster itself: its engine joins the one RAY_ADDRESS names (or that `ray
    start` began on this machine), as vLLM's ray.init(address=None) does. It asked for a local cluster of its own,
    which Ray refuses where it finds one to join ("num_cpus ... must not be provided"): the engine failed to start."""
    monkeypatch.setattr("pagedllm.engine.arg_utils._ray_initialized", lambda: False)  # as serve's frontend
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    assert_tp2_pp2_across_the_nodes(ray, tmp_path, tokenizer)


def test_tiny_model_tp2(ray, tmp_path, tokenizer):
    reference = save_tiny_model(tmp_path, tokenizer, "llama")
    assert_parity(reference, generate(tmp_path, tensor_parallel_size=2, distributed_executor_backend="ray"))


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2)])
def test_default_model(ray, prompts, expected, parallel):
    with running_llm(distributed_executor_backend="ray", **parallel, **STRESS) as llm:
        assert_same(run(llm, prompts), expected)
        assert llm.get_stats().num_preemptions > 0


def test_a_rank_that_raises_is_named_with_its_exception_not_its_traceback(ray, monkeypatch):
    """As with the multi-process executor: the error a server's clients read names the rank and the exception; the
    traceback Ray's error carries stays in the log."""
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # the executor in this process, to call it
    with running_llm(distributed_executor_backend="ray", pipeline_parallel_size=2, dtype="float32",
                     max_model_len=256, kv_cache_memory="32MiB") as llm:
        with pytest.raises(WorkerError) as error:
            llm.llm_engine.engine_core.engine_core.executor.collective_rpc("no_such_method")
    assert re.fullmatch(r"worker rank [01] failed: AttributeError: 'Worker' object has no attribute 'no_such_method'",
                        str(error.value))


def test_a_rank_that_dies_while_the_engine_is_idle_ends_it_then(ray):
    """As with the multi-process executor: an idle engine looks at its actors, so one lost while nothing runs ends
    the engine then (a server's /health turns 503), not at the next request."""
    with running_llm(distributed_executor_backend="ray", pipeline_parallel_size=2, dtype="float32",
                     max_model_len=256, kv_cache_memory="32MiB") as llm:
        actors = [p for p in psutil.process_iter(["cmdline"])
                  if any("RayWorkerWrapper" in part for part in p.info["cmdline"] or ())]
        assert len(actors) == 2
        actors[1].kill()
        assert wait_until(lambda: llm.llm_engine.engine_core._mp.dead, 15), "the idle engine did not notice"
        with pytest.raises(EngineDeadError):
            llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
