"""Speculative decoding with draft trees on the (offloaded) target: growth, verification, decode loops.

Modules (import what you need; nothing heavy happens at package import):
- :mod:`live.spec.tree`: :class:`TokenTree`, the drafted tree (converts to ``specfit.tree.DraftTree``).
- :mod:`live.spec.draft`: :class:`TreeShape`, the :class:`Drafter` interface and :class:`ModelDrafter`
  (EAGLE-2 dynamic tree grown by a draft LM).
- :mod:`live.spec.attention`: the additive 4-D tree attention mask and KV-cache trimming.
- :mod:`live.spec.runner`: :class:`CachedLM`, a model with its own ``DynamicCache``.
- :mod:`live.spec.routing`: :class:`RouterCapture`, top-k experts and weights of every token.
- :mod:`live.spec.verify`: :class:`TreeVerifier` (prefill, one-pass tree verification, greedy acceptance).
- :mod:`live.spec.engine`: :class:`SpecDecoder` and the choosers (``ar``, ``full``); dense mode.
- :mod:`live.spec.planning`: :class:`PlannedChooser`, policy mode with ``specfit`` policies.
- :mod:`live.spec.costs`: the default cost model of a live run (quick measurement).
- :mod:`live.spec.recording`, :mod:`live.spec.session`: trace rows and the ``live.record`` run.
"""
