import os, numpy as np
import test_hybrid as th

def test_loop():
    n = int(os.environ.get("LOOPN", "30"))
    params = [p for p in th.test_hybrid_dilated_head_groups_slices_with_different_groups.pytestmark[0].args[1]]
    options, shape, kv = params[2]
    fails = []
    for i in range(n):
        try:
            th.test_hybrid_dilated_head_groups_slices_with_different_groups(options, shape, kv)
        except AssertionError as e:
            fails.append((i, str(e)))
            print("FAIL", i, e, flush=True)
    assert not fails, fails
