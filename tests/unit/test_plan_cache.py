"""Plans kept on disk (twinkle_strategy/planning/cache.py): the same question answered from the file, every other
question planned again, a broken or unwritable cache costing only time."""

import json

import pytest

from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.planning import PlanCache, PlanInputError, PlanRequest, plan_memory
from twinkle_strategy.planning import cache as plan_cache


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory):
    from twinkle_strategy.train.demo_model import TinySizes, qwen3_moe_config

    path = tmp_path_factory.mktemp("demo_config")
    qwen3_moe_config(TinySizes()).save_pretrained(path)
    return path


def _request(path, **changes):
    base = dict(model_path=str(path), strategy=StrategyConfig(ep_size=2, mixed_precision="no"), nproc_per_node=4,
                dtype="float32", micro_batch=4, max_length=64)
    return PlanRequest(**{**base, **changes})


@pytest.fixture(scope="module")
def fresh_plan(demo_config):
    return plan_memory(_request(demo_config))


def test_a_kept_plan_is_the_plan_and_is_read_back(demo_config, fresh_plan, tmp_path):
    cache = PlanCache(tmp_path)
    request = _request(demo_config)
    assert plan_memory(request, cache=cache) == fresh_plan  # measured, then kept
    (kept,) = tmp_path.glob("*.json")
    assert cache.path(request) == kept and plan_memory(request, cache=cache) == fresh_plan
    # Read back, not measured again: a figure changed in the file comes back changed.
    record = json.loads(kept.read_text())
    record["activations"]["base"] += 1
    kept.write_text(json.dumps(record))
    assert plan_memory(request, cache=cache).activations.base == fresh_plan.activations.base + 1


def test_the_key_is_everything_the_figures_depend_on(demo_config, tmp_path, monkeypatch):
    cache = PlanCache(tmp_path / "plans")
    request = _request(demo_config)
    path = cache.path(request)
    # The same config.json elsewhere is the same model; the budgets change the verdict, not the figures.
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text((demo_config / "config.json").read_text())
    assert cache.path(_request(copy)) == path
    assert cache.path(request.replace(device_memory=2**30, host_memory=2**34)) == path
    # Anything else is a new question: the request, config.json's text, the code, the installed packages.
    assert cache.path(request.replace(max_length=128)) != path
    assert cache.path(request.replace(strategy=StrategyConfig(ep_size=4, mixed_precision="no"))) != path
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": config["moe_intermediate_size"] * 2}))
    assert cache.path(_request(copy)) != path
    monkeypatch.setattr(plan_cache, "package_digest", lambda: "another version of the package")
    assert cache.path(request) != path
    monkeypatch.undo()
    monkeypatch.setattr(plan_cache, "installed_digest", lambda: "another torch")
    assert cache.path(request) != path


def test_the_verdict_and_fixes_follow_the_live_budget(demo_config, fresh_plan, tmp_path):
    cache = PlanCache(tmp_path)
    plan_memory(_request(demo_config), cache=cache)  # kept without a budget
    tight = _request(demo_config, device_memory=int(fresh_plan.peak * 0.8))
    uncached = plan_memory(tight)
    cached = plan_memory(tight, cache=cache)
    assert cached.fits is False and cached.request.device_memory == tight.device_memory
    assert cached.fixes and cached.fixes == uncached.fixes  # each fix re-planned, and kept under its own key
    assert len(list(tmp_path.glob("*.json"))) == 1 + len(cached.fixes)


def test_a_broken_or_unwritable_cache_only_costs_time(demo_config, fresh_plan, tmp_path):
    request = _request(demo_config)
    cache = PlanCache(tmp_path)
    cache.path(request).write_text('{"notes": [')  # cut short (a disk that filled up)
    assert plan_memory(request, cache=cache) == fresh_plan
    assert json.loads(cache.path(request).read_text())["states"]  # written again, whole
    blocked = tmp_path / "a file"
    blocked.write_text("")
    assert plan_memory(request, cache=PlanCache(blocked / "plans")) == fresh_plan  # a directory that cannot be made
    assert not list(tmp_path.glob("*.tmp"))


def test_a_missing_config_is_still_the_plans_one_line(tmp_path):
    with pytest.raises(PlanInputError) as info:
        plan_memory(_request(tmp_path / "nowhere"), cache=PlanCache(tmp_path / "plans"))
    assert str(tmp_path / "nowhere" / "config.json") in str(info.value) and not (tmp_path / "plans").exists()
