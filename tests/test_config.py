"""Config: the committed JSON schema matches the typed config, and every key is documented."""

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from mixquant.config import (
    ConfigError,
    MixquantConfig,
    config_keys_markdown,
    json_schema,
    load_config_file,
    validate_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [str(path.relative_to(REPO)) for path in sorted((REPO / "config").glob("*.yaml"))]


def test_committed_schema_is_generated_from_the_typed_config():
    committed = json.loads((REPO / "workflow" / "schemas" / "config.schema.json").read_text())
    assert committed == json_schema(), "run: mixquant schema --write workflow/schemas/config.schema.json"


def test_every_object_in_the_schema_forbids_unknown_keys():
    schema = json_schema()
    objects = [schema, *schema["$defs"].values()]
    assert all(obj.get("additionalProperties") is False for obj in objects if obj.get("type") == "object")


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate_against_both(name):
    raw = yaml.safe_load((REPO / name).read_text())
    jsonschema.validate(raw, json_schema())
    load_config_file(REPO / name)


def _dotted_keys(model=MixquantConfig, prefix=""):
    for name, field in model.model_fields.items():
        yield prefix + name
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            for inner in (candidate, *getattr(candidate, "__args__", ())):
                if isinstance(inner, type) and hasattr(inner, "model_fields"):
                    yield from _dotted_keys(inner, f"{prefix}{name}.")


def test_config_readme_explains_every_key():
    readme = (REPO / "config" / "README.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9.]+)`", readme))
    missing = sorted(set(_dotted_keys()) - documented)
    assert not missing, f"config/README.md does not explain: {missing}"
    table = readme.split("## Every key", 1)[1]
    assert all(row in table for row in config_keys_markdown()), "run: mixquant schema --markdown"


def test_reference_config_carries_the_published_numbers():
    cfg = load_config_file(REPO / "config/laguna-s-2.1.yaml")
    assert (
        cfg.published.prompt_token_ids == "1f4a417c5159d1ac1202e38c0cb4573955d8ceb2037d8e316b7c3344267959d6"
    )
    assert cfg.published.safetensors_index.startswith("0a12b7fa")
    assert cfg.expected.tensors == 101_377 and cfg.expected.payload_bytes == 92_433_871_744
    assert (cfg.calibration.num_samples, cfg.calibration.seq_len, cfg.prompt.seq_len) == (512, 512, 2048)
    assert cfg.model.hub.revision == "a50e85e7e0aae7b0a504d156bd36a616ec9fea38"


def test_errors_are_one_line():
    with pytest.raises(ConfigError) as error:
        validate_config({"dataset": {"source": "local"}, "model": {"sorce": "toy"}}, "cfg.yaml")
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("cfg.yaml: ")


def test_a_yaml_error_is_one_line_with_where(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("calibration: [64\nprompt: {}\n")
    with pytest.raises(ConfigError) as error:
        load_config_file(path)
    assert str(error.value) == f"{path}: not valid YAML: expected ',' or ']', but got ':' at line 2, column 7"


def test_paths_outside_the_workdir_are_refused_unless_allowed_by_one_documented_key():
    field = MixquantConfig.model_fields["allow_outside_workdir"]
    assert field.default is False and "outside the working directory" in field.description
    committed = json.loads((REPO / "workflow" / "schemas" / "config.schema.json").read_text())
    assert (
        committed["properties"]["allow_outside_workdir"]
        == json_schema()["properties"]["allow_outside_workdir"]
    )


def test_null_and_tilde_from_the_command_line_unset_a_pin():
    from snakemake.cli import parse_config
    from snakemake.utils import update_config

    for spelling in ("null", "~", "NULL"):
        raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        update_config(raw, parse_config([f"published={{quant_config: {spelling}, made_from: {spelling}}}"]))
        cfg = validate_config(raw)
        assert cfg.published.quant_config is None and cfg.published.made_from is None
        assert cfg.published.prompt_token_ids is not None  # the others stay pinned
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    update_config(raw, parse_config(["calibration={num_samples: null}"]))
    with pytest.raises(ConfigError) as error:
        validate_config(raw, "config/config.yaml with --config calibration")
    assert str(error.value) == (
        "config/config.yaml with --config calibration: config key 'calibration.num_samples' cannot be null: "
        "give it a value"
    )
