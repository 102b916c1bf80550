"""Notebook 01 (CI parameters): every family written natively, detected, read back exactly."""
import math

import pytest

FP16_STORED = ("svdllm", "svdllm_v2", "dobi", "dobi-remap")


@pytest.mark.notebook
def test_checkpoint_normalization_notebook(executed_notebook):
    m = executed_notebook("01_checkpoint_normalization")
    assert set(m["formats_detected"]) == {"svdllm", "asvd", "basis_sharing", "dobi", "dobi-remap", "palu", "lowrank"}
    assert len(m["ppl"]) == 8 * len(m["keeps"])
    for key, err in m["roundtrip_rel_err"].items():
        fam = key.split("@")[0]
        assert err < (2e-3 if fam in FP16_STORED else 1e-5), (key, err)
    for key, ppl in m["ppl"].items():
        assert math.isfinite(ppl) and ppl > 1
    for key, k in m["linear_keep"].items():
        fam, keep = key.split("@")
        if fam not in ("palu", "dobi-remap"):          # palu: k/v only; remap: budget k*max(m,n)
            assert abs(k - float(keep)) < 0.03, (key, k)
    assert all(v > 0 for k, v in m["shared_params_saved"].items() if k.startswith("basis_sharing"))
    assert all(v == 0 for k, v in m["shared_params_saved"].items() if not k.startswith("basis_sharing"))
    dobi = [m["disk_bytes"][f"dobi@{k}"] for k in m["keeps"]]
    svd = [m["disk_bytes"][f"svd@{k}"] for k in m["keeps"]]
    assert all(d < s for d, s in zip(dobi, svd))        # fp16 files vs fp32
