"""Tied embeddings, decided as mlx-lm decides them: the config's flag, else the model's own ModelArgs default
(else Hugging Face's), and with a checkpoint folder its tensor names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from tiny_configs import TINY_CONFIGS

from kvrig.models import load_model_spec, spec_from_config
from kvrig.planner.weights import account_weights
from kvrig.recipes import parse_weights

CONFIGS = Path(__file__).parent / "configs"

# gemma-3-1b's published architecture, counted by hand: embeddings 262144 × 1152, 26 layers of attention
# (q 1152×1024, k and v 1152×256, o 1024×1152), MLP 3 × 1152 × 6912, norms 4 × 1152 + 2 × 256, a final norm.
GEMMA3_1B_TIED = (
    262144 * 1152 + 26 * (1152 * 1024 + 2 * 1152 * 256 + 1024 * 1152 + 3 * 1152 * 6912 + 4 * 1152 + 512) + 1152
)
GEMMA3_1B_HEAD = 262144 * 1152


def test_gemma3_1b_config_alone_ties_its_embeddings() -> None:
    """Its config.json says nothing about tying and mlx-lm's gemma3_text ties when the checkpoint has no head."""
    spec = load_model_spec(CONFIGS / "gemma-3-1b-it.json")
    assert GEMMA3_1B_TIED == 999_885_952
    assert account_weights(spec, parse_weights("q4")).parameters == GEMMA3_1B_TIED


def test_config_flag_wins() -> None:
    config = json.loads((CONFIGS / "gemma-3-1b-it.json").read_text())
    untied = spec_from_config({**config, "tie_word_embeddings": False})
    assert untied.parameter_count() == GEMMA3_1B_TIED + GEMMA3_1B_HEAD


def test_model_args_default_when_the_config_is_silent() -> None:
    """phi3's ModelArgs defaults to an untied head; llama's to a tied one."""
    phi3 = {k: v for k, v in TINY_CONFIGS["phi3"].items() if k != "tie_word_embeddings"}
    llama = {k: v for k, v in TINY_CONFIGS["llama"].items() if k != "tie_word_embeddings"}
    head = TINY_CONFIGS["llama"]["vocab_size"] * TINY_CONFIGS["llama"]["hidden_size"]
    assert spec_from_config({**llama, "tie_word_embeddings": False}).parameter_count() == (
        spec_from_config(llama).parameter_count() + head
    )
    assert (
        spec_from_config(phi3).parameter_count()
        == spec_from_config({**phi3, "tie_word_embeddings": False}).parameter_count()
    )


def _checkpoint(folder: Path, config: dict, *, with_head: bool) -> Path:
    """A real checkpoint written by MLX: the tiny model's tensors, with or without an LM head."""
    from kvrig.models.lazy import build_lazy_model

    folder.mkdir()
    model = build_lazy_model({**config, "tie_word_embeddings": not with_head})
    weights = dict(tree_flatten(model.parameters()))
    if with_head and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = mx.zeros((config["vocab_size"], config["hidden_size"]))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_folder_tensor_names_decide(tmp_path: Path) -> None:
    """The config claims an untied head; the checkpoint has none: names decide, as when mlx-lm loads it."""
    config = {**TINY_CONFIGS["gemma3_text"], "tie_word_embeddings": False}
    tied = _checkpoint(tmp_path / "tied", config, with_head=False)
    untied = _checkpoint(tmp_path / "untied", config, with_head=True)
    for folder in (tied, untied):
        loaded, _ = load_model(folder)  # mlx-lm's own loader: the independent answer
        expected = sum(p.size for _, p in tree_flatten(loaded.parameters()))
        assert load_model_spec(folder).parameter_count() == expected
    assert load_model_spec(tied).parameter_count() < load_model_spec(untied).parameter_count()
    shutil.rmtree(tmp_path)
