"""Where a model comes from: model ids (a path, the Hugging Face Hub, ModelScope) resolved to a local directory
(:mod:`.model_ids`), and the tiny checkpoints built on this machine (:mod:`.tiny`), the demo among them (:mod:`.demo`).
"""
