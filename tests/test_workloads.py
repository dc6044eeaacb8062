"""The benchmark workloads are the shared ones: same token ids, proven by the anchors' fingerprints."""
from pagedllm.benchmarks.workloads import FINGERPRINTS, shared_workloads


def test_shared_workloads_match_the_anchor_fingerprints():
    workloads = shared_workloads()
    assert {name: w.fingerprint() for name, w in workloads.items()} == FINGERPRINTS
    w3 = workloads["W3"]
    assert all(p[:1024] == w3.prompts[0][:1024] and len(p) == 1040 for p in w3.prompts)
    assert [len(p) for p in workloads["W1"].prompts] == [256] * 64 and workloads["W1"].max_tokens == 128
