"""Config: TOML + overrides precedence, one-line errors for unknown keys and wrong types, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.core.config import (
    Reduction,
    RunConfig,
    config_from_toml_text,
    dump_config,
    load_config,
    preset_path,
    replace,
    to_toml,
)

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_and_presets_load() -> None:
    assert load_config(None) == RunConfig()
    for preset in sorted((ROOT / "configs").glob("*.toml")):
        load_config(preset)


def test_precedence_cli_over_toml_over_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 7\nlr = 0.5\n[data]\nseq_len = 32\n")
    cfg = load_config(path, ["--train.steps=9", "--model.flavour=tiny", "--metrics.tensorboard=true"])
    assert cfg.train.steps == 9  # CLI beats TOML
    assert cfg.train.lr == 0.5  # TOML beats default
    assert cfg.data.seq_len == 32
    assert cfg.model.flavour == "tiny"
    assert cfg.metrics.tensorboard is True
    assert cfg.train.microbatches == RunConfig().train.microbatches  # default


def test_round_trip_through_resolved_toml(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", ['--data.source=some dir/with "quotes"'])
    assert config_from_toml_text(to_toml(cfg)) == cfg
    path = dump_config(cfg, tmp_path)
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    ("toml", "overrides", "message"),
    [
        ("[train]\nsteps = \n", [], "not valid TOML"),
        ("[train]\nstepz = 3\n", [], "unknown config key train.stepz"),
        ("[trainer]\nsteps = 3\n", [], "unknown config section [trainer]"),
        ('[train]\nsteps = "ten"\n', [], "train.steps = 'ten' has the wrong type; expected int"),
        ("[train]\nmicrobatches = 0\n", [], "train.microbatches = 0 must be >= 1"),
        ("", ["--train.steps=abc"], "train.steps = 'abc' has the wrong type"),
        ("", ["--train.nope=1"], "unknown config key train.nope"),
        ("", ["--model.flavour=huge"], "model.flavour = 'huge' is unknown"),
        ("", ["steps=3"], "malformed"),
        ("train = 3\n", [], "must be a table"),
    ],
)
def test_user_mistakes_are_one_line_value_errors(tmp_path: Path, toml: str, overrides: list[str], message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ValueError) as info:
        load_config(path, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config("/nonexistent/config.toml")


def test_a_config_derived_with_replace_holds_enum_members_as_a_loaded_one_does() -> None:
    """``replace(..., reduction="exact")`` gives ``Reduction.EXACT`` (the benchmarks derive their exact config so;
    with the plain string, every ``is Reduction.EXACT`` in the launcher said no); a value outside the enum is one
    ValueError naming the allowed ones."""
    cfg = load_config(str(preset_path("tiny")))
    derived = replace(cfg, recovery=replace(cfg.recovery, reduction="exact"))
    assert derived.recovery.reduction is Reduction.EXACT
    assert derived == load_config(str(preset_path("tiny")), ["--recovery.reduction=exact"])
    with pytest.raises(ValueError, match="reduction = 'nope': must be one of 'fp32', 'exact'"):
        replace(cfg.recovery, reduction="nope")
