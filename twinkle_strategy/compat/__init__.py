"""The one home for what twinkle_strategy takes from the internals of transformers, accelerate and torch.

Some of what the library needs has no public API: which tensors ``from_pretrained`` keeps in
fp32, transformers' checkpoint conversion rules, a tensor that holds no storage, a module's own
parameter slots. Those internals are read here and nowhere else
(``tests/unit/test_internals.py`` fails if another module touches a private name of transformers or
torch), each through one small wrapper that

* is declared with an :class:`Internal`: what the library uses it for, the versions it was checked
  on, and the public API that would replace it (the wrapper's docstring ends with the same);
* raises :class:`~twinkle_strategy.errors.InternalChangedError`, naming the internal and the
  installed version, when a release removes it;
* has a fast single-process unit test in ``tests/unit/test_internals.py`` of exactly the behaviour the
  library relies on, so that a release that changes it fails there, by name, rather than deep
  inside a multi-process run.

"Checked on" means: the unit tests pass with that version installed (transformers 5.19.0, 5.23.0
and 5.24.0; torch 2.13.0; accelerate 1.15.0), and for torch 2.14.1 that its source has the same
definitions. :func:`internals` lists them all; ``python -m twinkle_strategy.compat`` prints them.

registry.py              :class:`Internal`, the declaration, and the list of those declared
transformers_internals/  the wrappers of transformers and accelerate, one module per area (its own map)
torch_internals.py       the wrappers of torch
trl_internals.py         the GRPOTrainer steps the GRPO mixin overrides (TRL)
__main__.py              ``python -m twinkle_strategy.compat``: the list, with the installed versions

None of the wrappers imports transformers or TRL at import time.
"""

from twinkle_strategy.compat import torch_internals, transformers_internals, trl_internals  # noqa: F401  (they declare them)
from twinkle_strategy.compat.registry import Internal, declared


def internals() -> tuple[Internal, ...]:
    """Every internal twinkle_strategy uses, in declaration order."""
    return declared()
