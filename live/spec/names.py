"""Names of the live modes, policies and predictors (no heavy imports, so ``--help`` stays fast).

Policies (``--policy``): ``ar`` (root only, no draft), ``full`` (verify the whole drafted tree),
``chain`` (the draft's most likely path), ``topn`` (the ``max_nodes - 1`` most likely draft nodes,
EAGLE-3's tree), ``specfit`` (exact throughput-optimal subtree and stopping rule),
``cascade`` (topn when it beats ``ar`` by the cost model, else ``ar``); the last four come from
``specfit.policies``.
"""

MODES = ("dense", "policy")
LIVE_POLICIES = ("ar", "full", "chain", "topn", "specfit", "cascade")
PLANNED_POLICIES = ("chain", "topn", "specfit", "cascade")
LIVE_PREDICTORS = ("recent", "token-table", "union-size")
CACHE_POLICIES = ("lru", "lfu", "static")
DTYPES = ("float32", "bfloat16", "float16")
