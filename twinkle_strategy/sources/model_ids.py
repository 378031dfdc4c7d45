"""Model ids to local directories: a path, ``hf://org/name``, ``ms://org/name``, a bare ``org/name``, ``tiny://demo``.

A bare ``org/name`` means what it means to the front-end it was given to, and a message about a hub that
could not give a model says how to reach the other hub in that front-end's own words (a
:class:`HubConvention`):

* Python (``NativeFSDPStrategy.from_pretrained``, the HF Trainer and TRL front-end): transformers'
  convention, the Hugging Face Hub, through huggingface_hub and its rules (its cache, ``HF_HOME``,
  ``HF_HUB_OFFLINE=1`` for the cache only). :data:`PYTHON_HUBS`.
* ``twinkle-sft`` and the swift plugin: swift's convention, ModelScope unless ``USE_HF`` / swift's switch says
  otherwise (:func:`hub_for_bare_ids`); they qualify the id with its hub before it reaches the library and
  pass their own :class:`HubConvention` for the messages.

``tiny://demo`` is the embedded demo model (:func:`twinkle_strategy.sources.demo.demo_model_path`), built once.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re

from twinkle_strategy.checkpoint.directories import raise_if_incomplete
from twinkle_strategy.errors import CheckpointError
from twinkle_strategy.sources.demo import DEMO_MODEL_ID, demo_model_path

HF_PREFIX, MS_PREFIX, TINY_PREFIX = "hf://", "ms://", "tiny://"
# ``org/name`` as both hubs spell repository ids (letters, digits, '-', '_', '.').
_BARE_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class Hub(str, enum.Enum):
    """A hub model ids are taken from; the value is its prefix."""

    MODELSCOPE = MS_PREFIX
    HUGGING_FACE = HF_PREFIX

    @property
    def title(self) -> str:
        return "ModelScope" if self is Hub.MODELSCOPE else "the Hugging Face Hub"


@dataclasses.dataclass(frozen=True)
class HubConvention:
    """Where a front-end takes a bare ``org/name`` from, and how its users ask for each hub (``{id}``: ``org/name``).

    ``to_hugging_face`` / ``to_modelscope`` complete "take it from <hub> (...)" in a message, in the front-end's
    words: a Python argument for the library, a flag for a command line.
    """

    bare_ids: Hub
    to_hugging_face: str
    to_modelscope: str

    def way_to(self, hub: Hub, repo: str) -> str:
        return (self.to_hugging_face if hub is Hub.HUGGING_FACE else self.to_modelscope).format(id=repo)


# transformers' convention: what from_pretrained("org/name") means to a transformers or TRL user.
PYTHON_HUBS = HubConvention(bare_ids=Hub.HUGGING_FACE, to_hugging_face="pass '{id}' or 'hf://{id}'",
                            to_modelscope="pass 'ms://{id}'")


def hub_for_bare_ids(use_hf: bool | None = None) -> Hub:
    """swift's rule (ms-swift 4.6 ``get_hub``): ModelScope, unless ``use_hf`` is true or, when it is not given
    (None), the environment variable ``USE_HF`` is true."""
    if use_hf is None:
        use_hf = os.environ.get("USE_HF", "0").strip().lower() in ("1", "true", "yes", "y", "t", "on")
    return Hub.HUGGING_FACE if use_hf else Hub.MODELSCOPE


def qualified_model_id(path_or_id: str, *, use_hf: bool | None = None, bare_ids: Hub | None = None) -> str:
    """``path_or_id`` with its hub named: a bare ``org/name`` that is not a local path becomes
    ``<hub>://org/name``, the hub being ``bare_ids`` or else swift's :func:`hub_for_bare_ids` (``use_hf``);
    anything else is returned as it is.

    As swift and transformers do, an existing local path wins over a hub id of the same spelling.
    """
    if "://" in path_or_id or os.path.exists(path_or_id) or not _BARE_HUB_ID.match(path_or_id):
        return path_or_id
    return (bare_ids or hub_for_bare_ids(use_hf)).value + path_or_id


def resolve_model_path(path_or_id: str, *, hubs: HubConvention = PYTHON_HUBS) -> str:
    """A local directory for ``path_or_id``: a local path, ``hf://org/name``, ``ms://org/name``, ``tiny://demo``,
    or a bare ``org/name`` taken from ``hubs.bare_ids`` (the Hugging Face Hub by default, as transformers does).

    ``hf://``: huggingface_hub's ``snapshot_download`` and its rules: the snapshot in the
    cache (``HF_HOME``) when ``HF_HUB_OFFLINE=1`` or the Hub cannot be reached, else the
    Hub's latest revision. ``ms://``: a snapshot already in the ModelScope cache
    (``MODELSCOPE_CACHE``) is used as it is, without network access (modelscope has no
    offline switch of its own); otherwise modelscope downloads it.
    """
    if path_or_id.startswith(TINY_PREFIX):
        return _demo_path(path_or_id)
    path_or_id = qualified_model_id(path_or_id, bare_ids=hubs.bare_ids)
    if path_or_id.startswith((HF_PREFIX, MS_PREFIX)):
        cached = cached_model_path(path_or_id) if path_or_id.startswith(MS_PREFIX) else None
        if cached is not None:
            return cached
        try:
            return _snapshot_download(path_or_id, local_files_only=False)
        except Exception as exc:  # noqa: BLE001 - network, authentication and cache errors of either client
            raise CheckpointError(unavailable_id_message(path_or_id, exc, hubs=hubs)) from exc
    if not os.path.isdir(path_or_id):
        raise CheckpointError(
            f"model path {path_or_id!r} does not exist or is not a directory; pass a local checkpoint directory, "
            "'org/name' or 'hf://org/name' for the Hugging Face Hub, 'ms://org/name' for ModelScope, or "
            f"'{TINY_PREFIX}demo' for the embedded demo model"
        )
    raise_if_incomplete(path_or_id)
    return path_or_id


def _demo_path(model_id: str) -> str:
    if model_id not in (DEMO_MODEL_ID, TINY_PREFIX):
        raise CheckpointError(f"unknown embedded model {model_id!r}: the one there is is {DEMO_MODEL_ID!r} "
                              "(twinkle_strategy.demo_model_path())")
    return demo_model_path()


def unavailable_id_message(model_id: str, exc: Exception, *, hubs: HubConvention = PYTHON_HUBS) -> str:
    """One line: which hub could not give ``model_id``, its client's reason (first line), and the fixes."""
    hub = Hub(model_id[:len(MS_PREFIX)])
    other = Hub.HUGGING_FACE if hub is Hub.MODELSCOPE else Hub.MODELSCOPE
    reason = (str(exc).strip().splitlines() or [""])[0]
    return (f"could not get {model_id} from {hub.title}: {type(exc).__name__}: {reason}; check the "
            f"id and the network, or take it from {other.title} ({hubs.way_to(other, model_id[len(MS_PREFIX):])}), "
            "or pass a local checkpoint directory")


def cached_model_path(model_id: str) -> str | None:
    """The local snapshot of an ``hf://`` or ``ms://`` id if its hub's cache holds one with a config.json
    (no network access, nothing written), else None."""
    try:
        path = _snapshot_download(model_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - "not in the cache" has a different class in each client
        return None
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def _snapshot_download(model_id: str, local_files_only: bool) -> str:
    if model_id.startswith(MS_PREFIX):
        from modelscope import snapshot_download
    else:
        from huggingface_hub import snapshot_download
    repo = model_id.split("://", 1)[1]
    return str(snapshot_download(repo, local_files_only=local_files_only))
