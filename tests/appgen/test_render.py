"""The generated project: every Swift file parses, values are escaped, options and bundles are checked."""

from __future__ import annotations

import json
import os
import plistlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tree_sitter
import tree_sitter_swift
import yaml

from kvrig.appgen.escape import swift_string
from kvrig.appgen.render import MARKER, AppOptions, product_name, render_app, templates_root
from kvrig.exceptions import AppExistsError, BundleError, InputError, VerifyError

PARSER = tree_sitter.Parser(tree_sitter.Language(tree_sitter_swift.language()))


def syntax_errors(source: bytes) -> list[str]:
    problems = []
    stack = [PARSER.parse(source).root_node]
    while stack:
        node = stack.pop()
        if node.type == "ERROR" or node.is_missing:
            problems.append(f"{node.type} at {node.start_point}: {source[node.start_byte : node.end_byte][:60]!r}")
        stack.extend(node.children)
    return problems


def test_every_swift_file_parses(reference_project: Path) -> None:
    files = sorted(reference_project.rglob("*.swift"))
    names = {f.name for f in files}
    assert {
        "Engine.swift",
        "AppConfig.swift",
        "Package.swift",
        "KVCacheConfig.swift",
        "ContractTests.swift",
    } <= names
    for path in files:
        assert syntax_errors(path.read_bytes()) == [], path


def test_parse_check_catches_broken_swift() -> None:
    # Control: the check above would see an unescaped quote in a literal.
    assert syntax_errors(b'let name = "My "LLM""\nlet x = 1\n')
    # tree-sitter accepts a raw newline inside "..." (Swift does not): the swiftc test below covers that.


NASTY_NAMES = [
    'My "LLM"',
    "back\\slash\\",
    'triple """ quotes """',
    "multi\nline\r\ttab",
    "interp \\(exit(1)) and \\\\(x)",
    "emoji 🦊 and \u2028 separator",
    "<plist> & 'xml'",
]


def test_escaped_names_compile_and_show_the_name(tmp_path: Path, make_bundle, swift: str) -> None:  # type: ignore[no-untyped-def]
    """The real Swift compiler builds AppConfig.swift for each name and prints it back unchanged."""
    bundle = make_bundle(tmp_path / 'weird "bundle" \\(x)')
    mains = []
    for i, name in enumerate(NASTY_NAMES):
        out = tmp_path / f"app{i}"
        render_app(bundle, out, AppOptions(name=name, bundle_id="com.example.x"))
        source = (out / "App/Sources/AppConfig.swift").read_text()
        assert syntax_errors(source.encode()) == []
        # Rename the enum so all variants compile into one program.
        mains.append(source.replace("enum AppConfig", f"enum AppConfig{i}").replace("import Foundation\n", ""))
        plist = plistlib.loads((out / "App/Info.plist").read_bytes())
        assert plist["CFBundleDisplayName"] == name.replace("\r", "\n") or plist["CFBundleDisplayName"] == name
        assert plist["UIFileSharingEnabled"] is True
    program = "import Foundation\n" + "\n".join(mains) + "\n"
    program += "".join(
        f"print(Array(AppConfig{i}.displayName.unicodeScalars.map {{ $0.value }}), AppConfig{i}.bundleFolder)\n"
        for i in range(len(NASTY_NAMES))
    )
    (tmp_path / "main.swift").write_text(program)
    swiftc = str(Path(swift).with_name("swiftc"))
    subprocess.run(
        [swiftc, "-o", str(tmp_path / "names"), str(tmp_path / "main.swift")],
        env={**os.environ, "TMPDIR": str(tmp_path)},  # swiftc leaves a folder in TMPDIR on each run
        check=True,
    )
    lines = subprocess.run([str(tmp_path / "names")], capture_output=True, text=True, check=True).stdout.splitlines()
    for name, line in zip(NASTY_NAMES, lines, strict=True):
        scalars, _, folder = line.partition("] ")
        assert [int(x) for x in scalars.strip("[").split(", ")] == [ord(c) for c in name]
        assert folder == 'weird "bundle" \\(x)'


def test_swift_string_escapes() -> None:
    assert swift_string('a"b') == '"a\\"b"'
    assert swift_string("\\(x)") == '"\\\\(x)"'
    assert swift_string("\n\u2028") == '"\\n\\u{2028}"'
    with pytest.raises(TypeError):
        swift_string(3)


def test_swift_templates_escape_every_value() -> None:
    """Each `{{ ... }}` in a Swift template ends in a Swift escaper, so no value lands raw in Swift."""
    templates = list(templates_root().rglob("*.swift.j2"))
    expressions = [(t.name, e) for t in templates for e in re.findall(r"\{\{(.*?)\}\}", t.read_text())]
    assert len(templates) >= 2 and expressions, "no Swift templates with values found"
    for name, expression in expressions:
        assert re.search(r"\|\s*swift_(string|int|bool)\s*$", expression), (name, expression)


def test_project_yml_plist_entitlements(reference_project: Path) -> None:
    spec = yaml.safe_load((reference_project / "project.yml").read_text())
    target = spec["targets"]["SmolLM2Chat"]
    assert target["settings"]["base"]["PRODUCT_BUNDLE_IDENTIFIER"] == "com.example.smollm2"
    assert target["settings"]["base"]["DEVELOPMENT_TEAM"] == "ABCDE12345"
    packages = spec["packages"]
    assert packages["MLXSwiftLM"]["exactVersion"].startswith("3.31.")
    assert packages["MLXSwift"]["exactVersion"] == "0.31.4"
    assert packages["SwiftTransformers"]["exactVersion"].startswith("1.3.")
    assert packages["KvrigCore"]["path"] == "Core"
    products = {(d["package"], d["product"]) for d in target["dependencies"]}
    assert {
        ("MLXSwiftLM", "MLXLLM"),
        ("MLXSwiftLM", "MLXLMCommon"),
        ("SwiftTransformers", "Tokenizers"),
    } <= products
    entitlements = plistlib.loads((reference_project / "App/App.entitlements").read_bytes())
    assert entitlements == {
        "com.apple.developer.kernel.increased-memory-limit": True,
        # Apple's key for Background GPU Access (BackgroundTasks' BGTaskRequest.h, BGContinuedProcessingTaskRequest)
        "com.apple.developer.background-tasks.continued-processing.gpu": True,
    }
    info = plistlib.loads((reference_project / "App/Info.plist").read_bytes())
    assert info["CFBundleDisplayName"] == "SmolLM2 Chat"
    assert info["UIFileSharingEnabled"] is True
    # BGContinuedProcessingTaskRequest identifiers: "<MainBundle>.<SemanticContext>.*" (BGTaskRequest.h)
    assert info["BGTaskSchedulerPermittedIdentifiers"] == ["com.example.smollm2.soak.*"]


def test_the_app_stops_gpu_work_in_the_background(reference_project: Path) -> None:
    """The rendered app follows its scene and asks for iOS 26's continued-processing task with the GPU only where
    the device supports it, with Apple's spellings (BackgroundTasks' headers: BGTaskScheduler.supportedResources,
    BGContinuedProcessingTaskRequest(identifier:title:subtitle:), requiredResources = .gpu)."""
    sources = reference_project / "App/Sources"
    app = (sources / "KvrigApp.swift").read_text()
    assert "@Environment(\\.scenePhase)" in app and "engine.sceneChanged(active: phase == .active)" in app
    loop = (sources / "TokenLoop.swift").read_text()
    # every forward pass (prefill chunks, the last prefill token, each decode step with its sampling) asks first
    assert loop.count("admitted(.prefill)") == 2 and loop.count("admitted(.decode)") == 1
    # a reply ends where MLXLMCommon's generate loop ends it: every end id the model's configs name, not only the
    # tokenizer's (Gemma's <end_of_turn> and Llama 3's <|eot_id|> are in generation_config.json alone)
    assert "context.configuration.eosTokenIds" in loop and "configuration.extraEOSTokens" in loop
    assert "stop.contains(id) || id == unknown" in loop and "tokenizer.eosTokenId\n" not in loop
    engine = (sources / "Engine.swift").read_text()  # the Core ML chat reads the same ids from the bundle's configs
    assert "Self.endTokenIds(in: bundleURL)" in engine and "eos: tokenizer.eosTokenId" not in engine
    background = (sources / "Backgrounding.swift").read_text()
    for spelling in (
        "BGTaskScheduler.supportedResources.contains(.gpu)",
        "BGContinuedProcessingTaskRequest(identifier: identifier, title:",
        "request.requiredResources = .gpu",
        "BGTaskScheduler.shared.register(forTaskWithIdentifier: identifier, using: nil)",
        "try BGTaskScheduler.shared.submit(request)",
        "continued.expirationHandler",
        "setTaskCompleted(success:",
        "if #available(iOS 26.0, *)",
    ):
        assert spelling in background, spelling
    # the task's types are in the iOS 26 SDK only (Xcode 26, Swift 6.2): an older Xcode must still build the app
    guards = [line.strip() for line in background.splitlines() if line.strip().startswith("#if canImport(Background")]
    assert guards[0] == "#if canImport(BackgroundTasks) && os(iOS)"  # the import alone
    assert guards[1:] and all(g.endswith("&& compiler(>=6.2)") for g in guards[1:]), guards
    engine = (sources / "Engine.swift").read_text()
    assert "ContinuedProcessing.begin(" in engine and ".backgroundTaskExpired" in engine


def test_extended_virtual_addressing_option(tmp_path: Path, reference_bundle: Path) -> None:
    options = AppOptions(name="X", bundle_id="com.example.x", extended_virtual_addressing=True)
    render_app(reference_bundle, tmp_path / "p", options)
    entitlements = plistlib.loads((tmp_path / "p/App/App.entitlements").read_bytes())
    assert entitlements["com.apple.developer.kernel.extended-virtual-addressing"] is True
    spec = yaml.safe_load((tmp_path / "p/project.yml").read_text())
    assert "DEVELOPMENT_TEAM" not in spec["targets"]["X"]["settings"]["base"]


def test_schemas_exported(reference_project: Path) -> None:
    import json

    schema = json.loads((reference_project / "Schemas/kvcache.schema.json").read_text())
    assert {"key_bits", "value_bits", "layers", "schema"} <= set(schema["properties"])
    assert (reference_project / "Schemas/soakplan.schema.json").is_file()
    assert (reference_project / "Schemas/telemetry.schema.json").is_file()
    assert not (reference_project / "_meta").exists()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (AppOptions(name="X", bundle_id="not a bundle id"), "--bundle-id"),
        (AppOptions(name="X", bundle_id="com.example.x", team="short"), "--team"),
        (AppOptions(name="  ", bundle_id="com.example.x"), "--name"),
        # a final newline would reach Info.plist and project.yml (`$` matches before it)
        (AppOptions(name="X", bundle_id="com.example.x\n"), "--bundle-id"),
        (AppOptions(name="X", bundle_id="com.example.x", team="ABCDE12345\n"), "--team"),
    ],
)
def test_bad_options(tmp_path: Path, reference_bundle: Path, options: AppOptions, field: str) -> None:
    with pytest.raises(InputError) as info:
        render_app(reference_bundle, tmp_path / "out", options)
    assert info.value.field == field


def test_bad_bundle_names_file_and_field(tmp_path: Path, make_bundle, reseal) -> None:  # type: ignore[no-untyped-def]
    bundle = make_bundle(tmp_path / "b")
    (bundle / "kvcache.json").write_text('{"schema": 1, "scheme": "x"}')
    reseal(bundle)
    with pytest.raises(InputError) as info:
        render_app(bundle, tmp_path / "out", AppOptions(name="X", bundle_id="com.example.x"))
    assert "kvcache.json" in str(info.value) and info.value.field


def test_a_kvcache_other_than_the_manifest_records_is_refused(tmp_path: Path, make_bundle) -> None:  # type: ignore[no-untyped-def]
    """The manifest records the KV spec the bundle was measured with; a kvcache.json holding another is what the app
    would run: VerifyError (8), as `kvrig verify` says. The spec kvcache.json holds passes."""
    bundle = make_bundle(tmp_path / "b")
    manifest = json.loads((bundle / "manifest.json").read_text())
    options = AppOptions(name="X", bundle_id="com.example.x")
    for kv, refused in (("k4v4", True), ("k8v4+rot+s4+w128", False)):
        (bundle / "manifest.json").write_text(json.dumps({**manifest, "recipe": {**manifest["recipe"], "kv": kv}}))
        if refused:
            with pytest.raises(VerifyError) as info:
                render_app(bundle, tmp_path / "out", options)
            assert "kvcache.json holds k8v4+rot+s4+w128, where the manifest's recipe.kv says k4v4" in str(info.value)
            assert not (tmp_path / "out").exists()
        else:
            assert render_app(bundle, tmp_path / "out", options).files


@pytest.mark.parametrize("name", ["kvcache.json", "config.json"])
def test_a_file_edited_after_packaging_is_refused_as_deploy_refuses_it(tmp_path: Path, make_bundle, name: str) -> None:  # type: ignore[no-untyped-def]
    """The project takes the KV configuration and the model type from the bundle; one of them edited after packaging
    is VerifyError (8) naming the file, as `kvrig verify` and deploy say, and no project is written."""
    bundle = make_bundle(tmp_path / "b")
    edited = (bundle / name).read_text().replace("llama", "qwen2").replace('"max_context": 8192', '"max_context": 9')
    assert edited != (bundle / name).read_text()
    (bundle / name).write_text(edited)
    with pytest.raises(VerifyError) as info:
        render_app(bundle, tmp_path / "out", AppOptions(name="X", bundle_id="com.example.x"))
    assert info.value.exit_code == 8 and f"{name}: " in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_not_a_bundle_is_refused_as_everywhere(tmp_path: Path, make_bundle, reseal) -> None:  # type: ignore[no-untyped-def]
    """No manifest: BundleError (7), as verify, run and deploy say; a config.json that is no object names itself."""
    options = AppOptions(name="X", bundle_id="com.example.x")
    bundle = make_bundle(tmp_path / "b")
    (bundle / "config.json").write_text("[1, 2]")
    reseal(bundle)
    with pytest.raises(InputError) as info:
        render_app(bundle, tmp_path / "out", options)
    assert info.value.file == str(bundle / "config.json")
    (bundle / "manifest.json").unlink()
    with pytest.raises(BundleError) as refused:
        render_app(bundle, tmp_path / "out", options)
    assert refused.value.exit_code == 7 and "manifest.json" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_output_folder_not_overwritten_without_force(tmp_path: Path, reference_bundle: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    options = AppOptions(name="X", bundle_id="com.example.x")
    with pytest.raises(AppExistsError):
        render_app(reference_bundle, out, options)
    with pytest.raises(AppExistsError, match="not a project kvrig generated"):
        render_app(reference_bundle, out, options, replace=True)  # --replace replaces only what kvrig made
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    render_app(reference_bundle, out, options)  # an empty folder takes a project
    _as_if_rendered(out, "App/stale.swift")  # a file an older render wrote and listed
    (out / "build").mkdir()
    (out / "build" / "X.ipa").write_text("what kvrig build made")
    render_app(reference_bundle, out, AppOptions(name="Y", bundle_id="com.example.y"), replace=True)
    assert not (out / "App" / "stale.swift").exists() and "Y" in (out / "App" / "Info.plist").read_text()
    assert not (out / "build").exists()


def _as_if_rendered(project: Path, relative: str) -> None:
    """`relative` written into `project` and listed in its marker, as the render that made it would have."""
    (project / relative).write_text("// from an older render")
    marker = json.loads((project / MARKER).read_text())
    (project / MARKER).write_text(json.dumps({**marker, "files": [*marker["files"], relative]}))


@pytest.mark.parametrize("theirs", ["App/Sources/MyCode.swift", "mybundle/config.json", "notes.txt"])
def test_replace_keeps_a_project_that_holds_files_kvrig_did_not_write(
    tmp_path: Path, reference_bundle: Path, theirs: str
) -> None:
    """A generated project the user added to (their own source, the bundle itself copied in): --replace would
    delete those files with the project, so it refuses and touches nothing."""
    out = tmp_path / "out"
    options = AppOptions(name="X", bundle_id="com.example.x")
    render_app(reference_bundle, out, options)
    (out / theirs).parent.mkdir(parents=True, exist_ok=True)
    (out / theirs).write_text("mine")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    with pytest.raises(AppExistsError, match=f"holds files kvrig app did not write \\({theirs}\\)"):
        render_app(reference_bundle, out, options, replace=True)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    (out / MARKER).write_text("{}")  # a marker that lists nothing vouches for nothing
    with pytest.raises(AppExistsError, match="lists no files"):
        render_app(reference_bundle, out, options, replace=True)


def test_product_name() -> None:
    assert product_name('My "LLM" 2') == "MyLLM2"
    assert product_name("42 things") == "App42Things"
    assert product_name('"""') == "App"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvrig", *args], capture_output=True, text=True)


def test_cli_app_and_build_refusal(tmp_path: Path, reference_bundle: Path) -> None:
    out = tmp_path / "MyLLM"
    proc = run_cli("app", str(reference_bundle), "--name", "MyLLM", "--bundle-id", "com.example.myllm", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "project.yml").is_file()
    again = run_cli("app", str(reference_bundle), "--name", "MyLLM", "--bundle-id", "com.example.myllm", "-o", str(out))
    assert again.returncode == 35 and "not empty" in again.stderr
    bad = run_cli("app", str(reference_bundle), "--name", "X", "--bundle-id", "x y", "-o", str(tmp_path / "z"))
    assert bad.returncode == 3 and "--bundle-id" in bad.stderr and "Traceback" not in bad.stderr
    if sys.platform != "darwin":
        build = run_cli("build", str(out))
        assert build.returncode == 9
        assert "macOS" in build.stderr and "Traceback" not in build.stderr


def test_templates_ship_in_the_wheel() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    force = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert force["templates"] == "kvrig/_data/templates"
    assert (templates_root() / "project.yml.j2").is_file()
