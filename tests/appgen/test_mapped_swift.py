"""The app's mapped-weights Swift (issue 27 item 2), held where it cannot be compiled: MLX Swift does not resolve
on this machine, so the App sources are parsed with tree-sitter-swift and their calls into MLX Swift and
mlx-swift-lm are checked against the signatures of the pinned releases (mlx-swift 0.31.4, mlx-swift-lm 3.31.4),
read from their sources and written down here with file and line. Where MLX Swift resolves, `kvrig engine`
compiles the same files (tests/appgen/test_engine_*.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import tree_sitter
import yaml

from kvrig.appgen.render import PINS
from tests.appgen.test_render import PARSER, syntax_errors

# (callee as written, its first label) -> (argument labels in order, "_" for none; trailing closure), from the
# pinned sources.
PINNED_CALLS = {
    # mlx-swift 0.31.4 Source/MLX/MLXArray+Init.swift:78-81: init(rawPointer:_:dtype:finalizer:)
    ("MLXArray", "rawPointer"): (["rawPointer", "_", "dtype"], True),
    # mlx-swift 0.31.4 Source/MLX/MLXArray+Init.swift:374: init(_ value: [Int], _ shape:)
    ("MLXArray", "_"): (["_"], False),
    # mlx-swift 0.31.4 Source/MLX/Factory.swift:49-50: static zeros(_:dtype:stream:)
    ("MLXArray.zeros", "_"): (["_", "dtype"], False),
    # mlx-swift-lm 3.31.4 Libraries/MLXLMCommon/Registries/ModelTypeRegistry.swift:27
    ("LLMTypeRegistry.shared.createModel", "configuration"): (["configuration", "modelType"], False),
    # mlx-swift 0.31.4 Source/MLXNN/Quantized.swift:106-111: quantize(model:filter:apply:), filter as closure
    ("quantize", "model"): (["model"], True),
    # mlx-swift 0.31.4 Source/MLXNN/Module.swift:447-451: update(parameters:verify:path:modulePath:)
    ("model.update", "parameters"): (["parameters", "verify"], False),
    # mlx-swift 0.31.4 Source/MLX/Nested.swift:963: unflattened(_:) of [String: Element]
    ("ModuleParameters.unflattened", "_"): (["_"], False),
    # mlx-swift-lm 3.31.4 Libraries/MLXLMCommon/ModelConfiguration.swift:139-147
    ("ModelConfiguration", "directory"): (["directory", "stopStrings", "eosTokenIds", "toolCallFormat"], False),
    # mlx-swift-lm 3.31.4 Libraries/MLXLMCommon/Tool/ToolCallFormat.swift:159
    ("ToolCallFormat.infer", "from"): (["from", "configData"], False),
    # mlx-swift-lm 3.31.4 Libraries/MLXLMCommon/ModelFactory.swift:81-84
    ("ModelContext", "configuration"): (["configuration", "model", "processor", "tokenizer"], False),
    # mlx-swift-lm 3.31.4 Libraries/MLXLMCommon/ModelContainer.swift:53
    ("ModelContainer", "context"): (["context"], False),
    # mlx-swift-lm 3.31.4 Libraries/MLXLMCommon/LanguageModel.swift:161
    ("LMInput", "tokens"): (["tokens"], False),
    # mlx-swift-lm 3.31.4 Libraries/MLXLMCommon/Extensions/JSONDecoder+JSON5.swift:6
    ("JSONDecoder.json5", None): ([], False),
    # POSIX: mmap(addr, len, prot, flags, fd, offset); read-only and shared, never PROT_WRITE
    ("mmap", "_"): (["_", "_", "_", "_", "_", "_"], False),
}


def _text(source: bytes, node: tree_sitter.Node) -> str:
    return source[node.start_byte : node.end_byte].decode()


def calls(source: bytes) -> list[tuple[str, list[str], bool, list[str]]]:
    """Every call: (callee as written, argument labels with "_" for unlabeled, trailing closure, arguments)."""
    found = []
    stack = [PARSER.parse(source).root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.type != "call_expression":
            continue
        callee, *suffixes = node.children
        if callee.type == "call_expression":  # f(args) { closure }: the inner call has the arguments
            continue
        labels: list[str] = []
        values: list[str] = []
        closure = False
        for suffix in suffixes:
            for part in suffix.children:
                if part.type == "value_arguments":
                    for argument in part.children:
                        if argument.type == "value_argument":
                            label = argument.child_by_field_name("name")
                            labels.append(_text(source, label).rstrip(":").strip() if label else "_")
                            value = argument.child_by_field_name("value")
                            values.append(_text(source, value) if value else "")
                elif part.type == "lambda_literal":
                    closure = True
        if node.parent is not None and node.parent.type == "call_expression":
            closure = closure or any(p.type == "lambda_literal" for s in node.parent.children[1:] for p in s.children)
        found.append((_text(source, callee), labels, closure, values))
    return found


@pytest.fixture(scope="module")
def sources(reference_project: Path) -> dict[str, bytes]:
    names = ["App/Sources/WeightsMap.swift", "App/Sources/Engine.swift", "App/Sources/DeviceMemory.swift"]
    names += ["Runner/Sources/RunnerHost.swift", "Runner/Sources/HostFormat.swift", "Runner/Sources/main.swift"]
    return {name: (reference_project / name).read_bytes() for name in names}


def test_the_new_and_changed_swift_parses(sources: dict[str, bytes]) -> None:
    for name, source in sources.items():
        assert syntax_errors(source) == [], name
    # Control: the parse check sees a broken call.
    assert syntax_errors(b"let a = MLXArray(rawPointer: p, [1], dtype: .uint8 { }\n")


def test_the_swift_compiler_parses_them(
    sources: dict[str, bytes], reference_project: Path, swift: str, tmp_path: Path
) -> None:
    """The real compiler's parser (`swiftc -parse`: syntax only; without MLX Swift nothing here type-checks)."""
    swiftc = str(Path(swift).with_name("swiftc"))
    every = sorted((reference_project / "App/Sources").glob("*.swift")) + sorted(
        (reference_project / "Runner/Sources").glob("*.swift")
    )
    assert {str(p.relative_to(reference_project)) for p in every} >= set(sources)
    for path in every:  # the iOS-only files too: nothing else here reads them with Swift's own parser
        # swiftc leaves a folder in TMPDIR on each run: tmp_path's, not the machine's.
        done = subprocess.run(
            [swiftc, "-parse", str(path)], env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True
        )
        assert done.returncode == 0, (path.name, done.stderr[-2000:])


def test_calls_into_the_pinned_mlx_swift_match_their_signatures(sources: dict[str, bytes]) -> None:
    assert (PINS["mlx-swift"]["version"], PINS["mlx-swift-lm"]["version"]) == ("0.31.4", "3.31.4")
    made = calls(sources["App/Sources/WeightsMap.swift"])
    seen = set()
    for callee, labels, closure, _ in made:
        key = (callee, labels[0] if labels else None)
        if key in PINNED_CALLS:
            assert (labels, closure) == PINNED_CALLS[key], key
            seen.add(key)
        else:  # a call of a pinned name with other labels is an initialiser or overload not checked here
            assert callee not in {k[0] for k in PINNED_CALLS}, (callee, labels)
    assert seen == set(PINNED_CALLS)  # every one is called, so none of the checks above is vacuous


def test_the_weights_are_mapped_read_only_and_shared(sources: dict[str, bytes]) -> None:
    source = sources["App/Sources/WeightsMap.swift"]
    (mmap,) = [values for callee, _, _, values in calls(source) if callee == "mmap"]
    assert mmap[2:4] == ["PROT_READ", "MAP_SHARED"]
    assert b"PROT_WRITE" not in source
    assert [values for callee, _, _, values in calls(source) if callee == "munmap"] == [["base", "length"]]
    # The Darwin/Glibc imports stay behind canImport, as in the other App sources.
    assert b"#if canImport(Darwin)\nimport Darwin\n#elseif canImport(Glibc)\nimport Glibc\n#endif" in source


def test_the_engine_loads_through_the_map_and_reports_the_residency(sources: dict[str, bytes]) -> None:
    engine = calls(sources["App/Sources/Engine.swift"])
    (load,) = [labels for callee, labels, _, _ in engine if callee == "BundleLoader.load"]
    assert load == ["bundle", "config", "requested"]
    # MLX counts the mapped weights, jetsam does not: the MLX limit set before loading moves up by them.
    assert [values for callee, _, _, values in engine if callee == "raiseMemoryLimit"] == [
        ["loaded.weights.mappedBytes"]
    ]
    starts = [labels for callee, labels, _, _ in engine if callee == ".start"]
    assert any({"weightsResidency", "mappedWeightBytes", "residencyNote"} <= set(s) for s in starts), starts
    # The runner tells the virtual iPhone's kernel the mapped bytes, under the channel's name for them.
    runner = sources["Runner/Sources/RunnerHost.swift"]
    assert b'"mapped_weight_bytes": sample.mappedWeightBytes' in runner
    (sample,) = [labels for callee, labels, _, _ in calls(runner) if callee == "MemorySample"]
    assert "mappedWeightBytes" in sample


def test_the_xcode_project_links_mlxnn(reference_project: Path) -> None:
    spec = yaml.safe_load((reference_project / "project.yml").read_text())
    (target,) = spec["targets"].values()
    assert {"package": "MLXSwift", "product": "MLXNN"} in target["dependencies"]
    assert (reference_project / "App/Sources/WeightsMap.swift").is_file()
