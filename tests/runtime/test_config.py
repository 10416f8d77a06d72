"""FlashReinforceConfig: the builder, validation errors, resource checks and the dict round-trip."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashrl.algorithms import FlashReinforceConfig
from flashrl.algorithms.flash_reinforce.config import ConfigError


def _valid() -> FlashReinforceConfig:
    return (
        FlashReinforceConfig()
        .environment("flashrl/Math-v0", env_config={"difficulty": 3})
        .env_runners(num_env_runners=2, num_cpus_per_env_runner=0.25, engine="torch")
        .training(train_batch_size=8, delta=0.05, lr=1e-5)
    )


def test_builder_chains_and_sets_fields():
    config = _valid().learners(num_learners=2, num_cpus_per_learner=0.5).debugging(seed=7)
    assert (config.env, config.env_config) == ("flashrl/Math-v0", {"difficulty": 3})
    assert (config.num_env_runners, config.num_cpus_per_env_runner, config.engine) == (2, 0.25, "torch")
    assert (config.train_batch_size, config.delta, config.lr) == (8, 0.05, 1e-5)
    assert (config.num_learners, config.num_cpus_per_learner, config.seed) == (2, 0.5, 7)
    # Arguments not given keep their values.
    config.training(lr=2e-5)
    assert (config.delta, config.lr) == (0.05, 2e-5)
    config.validate()


def test_builder_methods_are_keyword_only():
    with pytest.raises(TypeError):
        FlashReinforceConfig().training(1e-5)  # type: ignore[misc]
    with pytest.raises(TypeError):
        FlashReinforceConfig().env_runners(2)  # type: ignore[misc]


def test_every_setting_has_a_docstring():
    import ast
    import inspect

    from flashrl.algorithms.flash_reinforce.config import _PARTS

    documented = set()
    for cls, _ in _PARTS.values():
        tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        for prev, nxt in zip(node.body, node.body[1:]):
            if isinstance(prev, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                documented.add(prev.target.id)
    missing = set(FlashReinforceConfig.setting_names()) - documented
    assert not missing


def test_dict_round_trip_is_exact():
    config = _valid().training(betas=(0.8, 0.95), negative_token_fraction=0.8, grad_clip=None)
    data = config.to_dict()
    assert data["betas"] == [0.8, 0.95]
    again = FlashReinforceConfig.from_dict(data)
    assert again == config
    assert again.betas == (0.8, 0.95)
    # A deep copy: mutating the dict does not touch the config.
    data["env_config"]["seed"] = 99
    assert config.env_config == {"difficulty": 3}


@settings(max_examples=40, deadline=None)
@given(
    lr=st.floats(1e-8, 1.0),
    batch=st.integers(2, 4096),
    delta=st.floats(1e-6, 10.0),
    runners=st.integers(1, 64),
    fraction=st.floats(0.0, 1.0),
    queue=st.one_of(st.none(), st.integers(1, 16)),
    samples=st.integers(1, 8),
)
def test_round_trip_property(lr, batch, delta, runners, fraction, queue, samples):
    config = _valid().training(lr=lr, train_batch_size=batch, delta=delta, negative_token_fraction=fraction)
    config.env_runners(num_env_runners=runners, async_queue_size=queue)
    config.evaluation(evaluation_num_samples_per_prompt=samples, evaluation_splits={"seen": {"split": "valid_seen"}})
    assert FlashReinforceConfig.from_dict(config.to_dict()) == config


def test_from_dict_names_the_closest_field():
    with pytest.raises(ConfigError, match="'train_batchsize' \\(did you mean 'train_batch_size'\\?\\)"):
        FlashReinforceConfig.from_dict({"train_batchsize": 4})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"lr": 0.0}, "lr: expected a finite number > 0, got 0.0"),
        ({"delta": -1.0}, "delta: expected a number >= 0 (math.inf = no trust region), got -1.0"),
        ({"delta": float("nan")}, "delta: expected a number >= 0 (math.inf = no trust region), got nan"),
        ({"train_batch_size": 1}, "train_batch_size: expected >= 2 with baseline 'batch_mean'"),
        ({"engine": "tgi"}, "engine: expected one of ('vllm', 'torch'), got 'tgi'"),
        ({"baseline": "no_such_baseline"}, "baseline: expected one of"),
        ({"baseline": "group_mean"}, "baseline: expected a per-batch baseline in 'async' mode"),
        ({"negative_token_fraction": 1.5}, "negative_token_fraction: expected a number in [0, 1], got 1.5"),
        ({"async_queue_size": 0}, "async_queue_size: expected None or an integer >= 1 (batches ahead of the learner), got 0"),
        ({"evaluation_num_samples_per_prompt": 0}, "evaluation_num_samples_per_prompt: expected an integer >= 1"),
        ({"evaluation_top_p": 0.0}, "evaluation_top_p: expected a number in (0, 1], got 0.0"),
        ({"evaluation_at_start": 1}, "evaluation_at_start: expected a bool, got 1"),
        ({"evaluation_splits": {"a/b": {}}}, "evaluation_splits: expected a dict of split name (str without '/')"),
        ({"evaluation_splits": {"seen": "valid_seen"}}, "evaluation_splits: expected a dict of split name"),
        ({"evaluation_datasource_key": ""}, "evaluation_datasource_key: expected None or a non-empty str"),
        ({"max_new_tokens": 4096}, "max_new_tokens: expected less than max_episode_tokens (2048), got 4096"),
        ({"rollout_mode": "sync_group", "train_batch_size": 12}, "Fix: use train_batch_size=8"),
        ({"episodes_in_flight_per_env_runner": 0}, "episodes_in_flight_per_env_runner: expected an integer >= 1"),
        ({"num_cpus_per_env_runner": -0.5}, "num_cpus_per_env_runner: expected a finite number >= 0"),
        ({"num_gpus_per_learner": 1.5}, "num_gpus_per_learner: expected a fraction <= 1 or a whole number"),
        ({"num_checkpoints_to_keep": 0}, "num_checkpoints_to_keep: expected None or an integer >= 1"),
        ({"env": "flashrl/Mth-v0"}, "did you mean 'flashrl/Math-v0'?"),
        ({"env": None}, "env: expected a registered Gymnasium id"),
        ({"optimizer": "lion"}, "optimizer: expected one of"),
    ],
)
def test_validate_says_expected_actual_and_fix(change, needle):
    config = FlashReinforceConfig.from_dict(_valid().to_dict() | change)
    with pytest.raises(ConfigError) as info:
        config.validate()
    message = str(info.value)
    assert needle in message
    assert "Fix:" in message


def test_validate_lists_every_problem_at_once():
    config = FlashReinforceConfig.from_dict(_valid().to_dict() | {"lr": -1.0, "engine": "x", "top_p": 0.0})
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert {"lr:", "engine:", "top_p:"} <= {line.split()[1] for line in str(info.value).splitlines()[1:]}


def test_sync_group_defaults_to_group_mean_and_warns():
    config = _valid().training(rollout_mode="sync_group", train_batch_size=16, group_size=8)
    assert config.effective_baseline == "group_mean"
    assert config.prompts_per_batch == 2
    with pytest.warns(UserWarning, match="comparison baseline"):
        config.validate()
    assert _valid().effective_baseline == "batch_mean"
    assert _valid().prompts_per_batch == 8


def test_truncated_sampling_warns():
    with pytest.warns(UserWarning, match="importance correction"):
        _valid().env_runners(top_p=0.9).validate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _valid().validate()


def test_resource_bundles_and_cluster_check():
    config = _valid().learners(num_learners=1, num_cpus_per_learner=0.5).resources(num_cpus_for_main_process=0.25)
    assert config.resource_bundles() == [{"CPU": 0.25}, {"CPU": 0.5}, {"CPU": 0.25}, {"CPU": 0.25}]
    config.validate_resources({"CPU": 2.0}, [{"CPU": 2.0}])
    config.env_runners(num_env_runners=4, num_cpus_per_env_runner=1.0)
    with pytest.raises(ConfigError) as info:
        config.validate_resources({"CPU": 2.0}, [{"CPU": 2.0}])
    assert "CPU: the run asks for 4.75 in total" in str(info.value)
    assert "but the cluster has 2" in str(info.value)
    gpu = _valid().env_runners(num_gpus_per_env_runner=1.0)
    with pytest.raises(ConfigError, match="GPU: the run asks for 2 in total .* but the cluster has 0"):
        gpu.validate_resources({"CPU": 8.0}, [{"CPU": 8.0}])


def test_single_actor_must_fit_on_one_node():
    config = _valid().env_runners(num_env_runners=1, num_cpus_per_env_runner=3.0)
    with pytest.raises(ConfigError, match="one actor asks for 3 but the largest node has 2"):
        config.validate_resources({"CPU": 4.0}, [{"CPU": 2.0}, {"CPU": 2.0}])


def test_local_learner_counts_in_the_main_bundle():
    config = _valid().learners(num_learners=0, num_cpus_per_learner=1.0, num_gpus_per_learner=1.0)
    assert config.resource_bundles()[0] == {"CPU": 1.5, "GPU": 1.0}


def test_loss_importable_without_ray():
    import subprocess
    import sys

    code = (
        "import sys; import flashrl.algorithms.flash_reinforce.loss; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
