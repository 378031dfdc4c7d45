"""Reinforcement learning on MoE models: what a rollout engine and the trainer exchange.

export_plan.py     pure: which rank assembles which rows of which tensor, in which bucket
export_sources.py  what an export sends: a full model, a LoRA model merged on the fly, or its adapter alone
weight_export.py   the export walk: owners send their rows, a destination assembles checkpoint tensors per bucket
export_report.py   bytes per rank, seconds blocked, peak extra memory, buckets
receivers.py       engine adapters over the walk: a callable, a plain transformers model, a process outside the group
"""
