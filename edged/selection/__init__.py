"""Picking, by measuring, the fastest variant and backend that stays accurate: the policy
(`policy`), the candidates per model (`candidates`), concrete inputs and reference data
(`inputs`), the micro-benchmark (`bench`), accuracy against the original (`accuracy`), the
selection run (`select`), its cached decision and evidence (`decision`) and why it won
(`explain`). The bottom of edged/: it imports no other part of it."""
