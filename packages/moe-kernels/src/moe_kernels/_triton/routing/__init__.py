"""Triton routing: each token's top-k experts, and the (expert, token) pairs sorted by expert.

Two to four launches, no host sync, no atomics but a cooperative launch's grid barrier; the
result is a pure function of the inputs (the oracle: ``moe_kernels.reference.routing``).

- A, top-k (``topk_rows``, ``topk_columns``): per program of tokens, every token's choices and
  the program's count per local expert into ``hist[expert, program]``. The row families rank
  (``keys``, ``networks``) and either rank each pair inside its expert or store bare choices;
  the ``columns`` family takes the top-k by a threshold (``threshold``) and places each pair
  among its program's pairs in sorted order itself. route's selection options (a bias, expert
  groups, scaled weights) take ``topk_grouped``, which stores bare choices.
- B, ``scan``: exclusive prefix sums of ``hist`` over programs (or C reduces ``hist`` itself).
- C, ``place``: offsets, counts and every pair at its sorted position (``place_rows`` for the
  row families), route's ``inverse``, the -1 tail.
- D, ``expert_runs``: after a scan launch, the ``columns`` family's pairs written one
  contiguous run per (group of programs, expert).
- ``fused``: A and C in one cooperative launch where the programs fit on the GPU at once.

``plan`` chooses the algorithms and sizes (``choose_plan``, the only override being
``Constraints``; pure Python, importable without Triton); ``launch.run`` runs a plan; ``eager``
relaunches an eager call's bound kernels.
What was tried and measured: ``docs/routing.md``.
"""
