"""Planned weight bytes equal the summed `nbytes` of a tiny model really quantized by mlx-lm."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.convert import mixed_quant_predicate_builder
from mlx_lm.utils import quantize_model
from tiny_configs import TINY_CONFIGS

from kvrig.compat.mlx_lm_classes import model_classes
from kvrig.exceptions import QuantizationError
from kvrig.models import spec_from_config
from kvrig.planner.weights import account_weights
from kvrig.recipes import parse_weights

RECIPES = ["q4", "q8", "mixed_3_6", "fp16"]


def quantized_nbytes(config: dict, recipe_name: str, group_size: int) -> int:
    """What mlx-lm's convert does: cast floats to fp16 (honouring cast_predicate), quantize, evaluate."""
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings"))
    if tied and hasattr(model, "sanitize"):
        # What mlx-lm's load does with a tied checkpoint (no lm_head tensor): gemma3 drops its head in sanitize.
        model.sanitize({k: v for k, v in tree_flatten(model.parameters()) if not k.endswith("lm_head.weight")})
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(mx.float16) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    recipe = parse_weights(recipe_name, group_size)
    if recipe.bits is not None:
        predicate = (
            mixed_quant_predicate_builder(recipe_name, model, group_size) if recipe_name.startswith("mixed") else None
        )
        quantize_model(model, copy.deepcopy(config), group_size, recipe.bits, quant_predicate=predicate)
    mx.eval(model.parameters())
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_planned_weight_bytes_equal_mlx_nbytes(family: str, recipe: str) -> None:
    config = TINY_CONFIGS[family]
    planned = account_weights(spec_from_config(config), parse_weights(recipe, 32), "float16").total_bytes
    assert planned == quantized_nbytes(config, recipe, 32)


def test_group_size_64_on_llama() -> None:
    config = TINY_CONFIGS["llama"]
    assert account_weights(spec_from_config(config), parse_weights("q4", 64)).total_bytes == quantized_nbytes(
        config, "q4", 64
    )


def test_parameter_count_matches_mlx() -> None:
    config = TINY_CONFIGS["qwen3"]
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    expected = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert account_weights(spec_from_config(config), parse_weights("q4")).parameters == expected
    assert spec_from_config(config).parameter_count() == expected


def test_unknown_recipe_is_a_clear_error() -> None:
    with pytest.raises(QuantizationError, match="q7"):
        parse_weights("q7")


def test_a_group_that_divides_no_layer_is_refused_not_written_as_floats() -> None:
    """mlx-lm leaves a layer float when the group does not divide its input width, silently; when that is every
    layer the recipe is unavailable (a bundle of float weights under a quantization block would be a lie)."""
    config = {**TINY_CONFIGS["llama"], "hidden_size": 96, "intermediate_size": 160, "head_dim": 24}
    assert quantized_nbytes(config, "q4", 128) == quantized_nbytes(config, "fp16", 128)  # mlx-lm: nothing quantized
    with pytest.raises(QuantizationError, match="group size 128 divides none"):
        account_weights(spec_from_config(config), parse_weights("q4", 128), "float16")
