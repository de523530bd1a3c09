"""Live policy mode: the ``specfit`` tree policies choose the verified subtree of each cycle.

For policy ``specfit`` the planner is asked after every draft level whether to keep drafting
(``SpecFitPolicy.keep_drafting``), with the current expert-cache contents and the predicted
experts of every draft node; then ``select`` returns the subtree to verify. ``chain`` and
``topn`` draft the maximal tree and select from it. The planner's predictions (expected
committed tokens, cycle seconds) and its decision seconds travel in :attr:`Choice.plan` to the
cycle record, next to the measured values.

Predictors available live:
- ``recent``: every node gets the union of the experts of the last ``window`` target tokens;
- ``token-table``: token id -> experts, from the fitted table of ``calibration.fit`` when given
  (``predictor_tables.npz``), overridden by an online table learned during the run (the experts
  each token was last routed to); unknown tokens fall back to ``recent``;
- ``union-size``: no per-node sets; the expected distinct experts per layer as a function of the
  node count (``union_size`` of ``predictor_tables.npz``, required), priced at the cache's
  observed miss fraction.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from live.spec.draft import Drafter, DraftResult, TreeShape
from live.spec.engine import Choice, ChooseState
from live.spec.names import LIVE_PREDICTORS, PLANNED_POLICIES
from live.spec.tree import TokenTree
from specfit import bitsets  # per cycle: an import inside choose runs importlib's fromlist code
from specfit.acceptance import path_accept_probs  # per question: not imported inside the hot path
from specfit.context import PolicyContext


class PlannedChooser:
    """A :class:`live.spec.engine.SubtreeChooser` driven by a ``specfit.policies`` tree policy.

    Args:
        drafter: grows the trees.
        shape: maximal tree (depth, top-k, node budget).
        policy: one of :data:`PLANNED_POLICIES` (``topn`` verifies ``shape.max_nodes - 1`` draft nodes).
        predictor: one of :data:`LIVE_PREDICTORS`.
        cost: ``specfit.cost.CycleCostModel`` used for the predictions.
        num_experts: experts per MoE layer ``E``.
        calibration: optional ``specfit.acceptance.AcceptanceCalibration``.
        window: recent target tokens used by the predictors.
        tables: arrays of ``calibration.fit``'s ``predictor_tables.npz`` (``union_size``
            float[L, M+1], ``token_ids`` int[V], ``token_bits`` uint64[V, L, W]), or None.
        stopping: ``specfit``'s stopping rule (``SpecFitPolicy(stopping=...)``: ``"expected"`` or
            ``"bound"``); ``None``: the policy's default. Only ``specfit`` takes one.

    Raises:
        ValueError: unknown policy or predictor (lists the valid ones), ``union-size`` without
            ``tables``, or a ``stopping`` rule that is unknown or given to another policy.
    """

    def __init__(
        self,
        drafter: Drafter,
        shape: TreeShape,
        policy: str,
        predictor: str,
        cost,
        num_experts: int,
        *,
        calibration=None,
        window: int = 4,
        tables: dict[str, np.ndarray] | None = None,
        stopping: str | None = None,
    ) -> None:
        from specfit.policies import LIVE_DEADLINE_FRACTION, make_tree_policy
        from specfit.predictors import make_predictor

        if policy not in PLANNED_POLICIES:
            raise ValueError(f"unknown planned policy {policy!r}; expected one of {list(PLANNED_POLICIES)}")
        if predictor not in LIVE_PREDICTORS:
            raise ValueError(f"unknown live predictor {predictor!r}; expected one of {list(LIVE_PREDICTORS)}")
        kwargs: dict[str, Any] = {"num_draft_nodes": shape.max_nodes - 1} if policy == "topn" else {}
        if stopping is not None:
            if policy != "specfit":
                raise ValueError(f"stopping rule {stopping!r}: only policy 'specfit' has one, not {policy!r}")
            kwargs["stopping"] = stopping
        if policy == "specfit":  # a live cycle cannot wait for a long search (issue 14)
            kwargs["deadline_fraction"] = LIVE_DEADLINE_FRACTION
        if policy == "specfit" or calibration is not None:  # compiled kernels will run
            from specfit.planner import warm_up

            # load them before the first timed cycle (the search only for per-node sets)
            warm_up(search=policy == "specfit" and predictor != "union-size")
        self.name = policy
        self.policy = make_tree_policy(policy, **kwargs)
        self.predictor_name = predictor
        self.recent = make_predictor("recent", window=window)
        self.table: dict[int, np.ndarray] = {}
        self.union_size = None
        if predictor == "union-size":
            if tables is None or "union_size" not in tables:
                raise ValueError(
                    "predictor 'union-size' needs fitted tables (union_size from calibration.fit)"
                )
            self.union_size = make_predictor("union-size", union_size=tables["union_size"])
        if predictor == "token-table" and tables is not None and "token_ids" in tables:
            bits = np.asarray(tables["token_bits"], dtype=np.uint64)
            self.table = {int(t): bits[i] for i, t in enumerate(np.asarray(tables["token_ids"]))}
        self.drafter, self.shape, self.cost = drafter, shape, cost
        self.num_experts, self.calibration, self.window = int(num_experts), calibration, int(window)
        self._questions = None  # SpecFit's expected rule on union sizes: one compiled call per question
        self._union_template = None  # a validated union-size prediction: its sizes serve every cycle
        if self.union_size is not None and getattr(self.policy, "stopping", None) == "expected":
            self._questions = self.policy.union_size_questions(cost, calibration, shape.depth, shape.max_nodes)

    def state_dict(self) -> dict[str, Any]:
        """What this chooser learned so far, as plain JSON: SpecFit's running root-acceptance
        estimate (``root_alpha``) and throughput guard (its realised cycles per arm and question
        count) and, with ``token-table``, the token table (token id -> bits uint64[L, W] as lists). ``live.record`` saves it after every finished request so that
        ``--resume`` continues with it (:meth:`load_state_dict`)."""
        state: dict[str, Any] = {}
        if hasattr(self.policy, "root_alpha"):
            state["root_alpha"] = float(self.policy.root_alpha)
        guard = getattr(self.policy, "guard", None)
        if guard is not None:  # SpecFit's throughput guard: its realised cycles and question count
            state["guard"] = {
                "arms": {arm: [list(c) for c in cycles] for arm, cycles in guard.arms.items()},
                "questions": int(guard.questions),
                "cycles": int(guard.cycles),
            }
        if self.predictor_name == "token-table":
            state["token_table"] = {str(t): np.asarray(b).tolist() for t, b in self.table.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output.

        Raises:
            ValueError: a value of the wrong type or shape.
        """
        try:
            if "root_alpha" in state and hasattr(self.policy, "root_alpha"):
                self.policy.root_alpha = float(state["root_alpha"])
            guard = getattr(self.policy, "guard", None)
            if "guard" in state and guard is not None:
                guard.cycles = int(state["guard"].get("cycles", 0))  # absent in states saved before the horizon
                for arm, cycles in state["guard"]["arms"].items():
                    guard.arms[arm].clear()
                    guard.arms[arm].extend(
                        (
                            float(c[0]),
                            float(c[1]),
                            int(c[2]) if len(c) > 2 else guard.cycles - 1,
                            float(c[3]) if len(c) > 3 and c[3] is not None else None,  # root alone's price
                        )
                        for c in cycles
                    )
                guard.questions = int(state["guard"]["questions"])
            if "token_table" in state and self.predictor_name == "token-table":
                self.table = {int(t): np.asarray(b, dtype=np.uint64) for t, b in state["token_table"].items()}
        except (TypeError, ValueError, AttributeError, OverflowError, KeyError) as exc:
            raise ValueError(f"planner state: {exc}") from exc

    def _learn(self, state: ChooseState, recent_bits: np.ndarray) -> None:
        """Online token table: the routed tokens are ``committed[:-1]``, newest last."""
        routed = list(state.committed[:-1])[-len(recent_bits) :] if len(recent_bits) else []
        for tok, bits in zip(routed, recent_bits):
            self.table[int(tok)] = bits

    def _predict(self, tree, state: ChooseState, recent_bits: np.ndarray | None):
        from specfit.predictors import PredictContext

        num_layers = self.cost.num_layers
        pctx = PredictContext(
            tree=tree,
            num_experts=self.num_experts,
            num_layers=num_layers,
            context_len=state.context_len,
            recent_experts=recent_bits if recent_bits is not None and len(recent_bits) else None,
            miss_fraction=state.miss_fraction,
        )
        if self.union_size is not None:
            return self.union_size.predict(pctx)
        base = self.recent.predict(pctx)
        if self.predictor_name == "recent":
            return base
        from specfit.node_experts import NodeExperts

        rows = [self.table.get(int(t), base.bits[i]) for i, t in enumerate(tree.token_ids)]
        return NodeExperts(self.num_experts, bits=np.stack(rows).astype(np.uint64), source="token-table")

    def _context(self, tree: TokenTree, levels: int, state: ChooseState, recent_bits: np.ndarray | None, cycle):
        """The planning problem of ``tree`` after ``levels`` levels; ``cycle`` holds what every
        question of one cycle shares (the cache bitsets, the union-size prediction)."""
        dtree = tree.to_draft_tree()
        node_experts = cycle["node_experts"]
        if node_experts is None:
            node_experts = self._predict(dtree, state, recent_bits)
            if self.union_size is not None:  # it depends on the state only: one per cycle
                cycle["node_experts"] = node_experts
        return PolicyContext.trusted(  # built here from checked parts (see to_draft_tree)
            tree=dtree,
            accept_probs=path_accept_probs(dtree, self.calibration),
            node_experts=node_experts,
            cached_bits=cycle["cached_bits"],
            cost=self.cost,
            context_len=state.context_len,
            num_levels=levels,
        )

    def choose(self, state: ChooseState) -> Choice:
        """Draft (asking the planner after each level when it can stop drafting) and select the subtree."""
        if self._questions is not None:
            return self._choose_by_questions(state)
        recent_bits = None
        if self.union_size is None:  # the union-size prediction needs no per-token sets
            recent_bits = (
                bitsets.pack(state.recent_experts, self.num_experts)
                if len(state.recent_experts)
                else np.zeros((0, self.cost.num_layers, bitsets.num_words(self.num_experts)), np.uint64)
            )
        if self.predictor_name == "token-table":
            self._learn(state, recent_bits)
        cached = state.cached_bits
        if cached is None:
            cached = bitsets.empty((self.cost.num_layers,), self.num_experts)
        # the same objects for every question of this cycle, so the planner's per-object memos
        # (union-size miss tables) are computed once per cycle
        cycle: dict[str, Any] = {"cached_bits": np.asarray(cached, dtype=np.uint64), "node_experts": None}
        asked_s = 0.0
        last_asked: list[Any] = [None, -1, None]  # (tree, levels, context) of the last question
        root = TokenTree.root_only(int(state.committed[-1]))

        def keep_drafting(tree: TokenTree, levels: int) -> bool:
            nonlocal asked_s
            start = time.perf_counter()
            ctx = self._context(tree, levels, state, recent_bits, cycle)
            last_asked[:] = [tree, levels, ctx]
            keep = self.policy.keep_drafting(ctx, self.shape.depth, self.shape.topk)
            asked_s += time.perf_counter() - start
            return keep

        def select(tree: TokenTree, levels: int) -> tuple[Any, Any]:
            # (plan, predicted per-node bits): the rule's last context when drafting stopped on its
            # "no" (same tree, same levels), so the selection is not searched twice
            if last_asked[0] is tree and last_asked[1] == levels:
                ctx = last_asked[2]
            else:
                ctx = self._context(tree, levels, state, recent_bits, cycle)
            return self.policy.select(ctx), ctx.node_experts.bits

        ask = keep_drafting if hasattr(self.policy, "keep_drafting") else None
        if ask is not None and not ask(root, 0):
            # the rule, asked on the root alone, says no level can pay: verify the root, draft nothing
            start = time.perf_counter()
            plan, bits = select(root, 0)  # the root's plan, just asked
            plan = plan.replaced(decision_s=time.perf_counter() - start + asked_s)
            return Choice(DraftResult(root, 0, 0.0), np.zeros(1, np.int64), plan, bits)
        asked_before_s = asked_s  # the level-0 question ran before grow: not inside its draft_s
        draft = self.drafter.grow(state.committed, self.shape, ask)
        asked_in_grow_s = asked_s - asked_before_s
        start = time.perf_counter()
        plan, bits = select(draft.tree, draft.num_levels)
        decision_s = time.perf_counter() - start + asked_s
        plan = plan.replaced(decision_s=decision_s)
        draft = dataclasses.replace(draft, draft_s=max(draft.draft_s - asked_in_grow_s, 0.0))
        return Choice(draft, np.asarray(plan.nodes, dtype=np.int64), plan, bits)

    def _choose_by_questions(self, state: ChooseState) -> Choice:
        """:meth:`choose` with SpecFit's compiled questions (``union-size``, expected rule): one
        compiled call per question on the drafter's arrays (the root question on the questions'
        own root arrays: no tree object unless the root alone is verified), the selection from the
        last answer, its plan stamped with the cycle's decision seconds (issue 14)."""
        cached = state.cached_bits
        if cached is None:
            cached = bitsets.empty((self.cost.num_layers,), self.num_experts)
        cached = np.asarray(cached, dtype=np.uint64)
        questions = self._questions
        start = time.perf_counter()
        observed = state.miss_fraction if self.union_size.miss_fraction is None else None
        if observed is None or self._union_template is None:
            # the predictor validates its sizes (first cycle) or has no observation to price
            root_tree = TokenTree.root_only(int(state.committed[-1])).to_draft_tree()
            self._union_template = self._predict(root_tree, state, None)
        questions.begin(self._union_template, cached, state.context_len, observed)
        keep = questions.ask(questions.root, 0)
        asked_s = time.perf_counter() - start
        if not keep:  # no level can pay: verify the root, draft nothing (the root's plan, just asked)
            plan = questions.select(questions.root, 0, asked_s)
            root = TokenTree.root_only(int(state.committed[-1]))
            return Choice(DraftResult(root, 0, 0.0), np.zeros(1, np.int64), plan, None)
        asked_in_grow_s = 0.0

        def keep_drafting(tree: TokenTree, levels: int) -> bool:
            nonlocal asked_in_grow_s
            start = time.perf_counter()
            keep = questions.ask(tree, levels)
            asked_in_grow_s += time.perf_counter() - start
            return keep

        draft = self.drafter.grow(state.committed, self.shape, keep_drafting)
        plan = questions.select(draft.tree, draft.num_levels, asked_s + asked_in_grow_s)
        draft = dataclasses.replace(draft, draft_s=max(draft.draft_s - asked_in_grow_s, 0.0))
        return Choice(draft, plan.nodes, plan, None)
