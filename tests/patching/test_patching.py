"""`megatron-fp4 patch` and the patch sets in megatron_fp4/patching/patches/.

Each release line's patch set is checked, applied, re-applied ("already applied") and reverted on
the megatron-core sdist it was made against (downloaded once with pip into a cache; a failed
download fails the test under CI=... and skips it elsewhere). The patched 0.19 and 0.18 trees are
then imported in a subprocess (PYTHONPATH=tree): MoELayer builds our dispatcher only when the config
asks for it, parse_args offers our flags only when megatron_fp4 is importable, and
core_transformer_config_from_args carries them onto the config. The rest (version detection, the diff engine, conflict reports) needs no network.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_fp4 import patching
from megatron_fp4.patching import unified_diff
from megatron_fp4.patching.unified_diff import APPLIED, APPLIES, CONFLICT

MOE_LAYER = "megatron/core/transformer/moe/moe_layer.py"
ARGUMENTS = "megatron/training/arguments.py"
ARGUMENT_UTILS = "megatron/training/argument_utils.py"
LINES = {line.name: line for line in patching.RELEASE_LINES}


# ----------------------------------------------------------------------------------------------------
# sdists: downloaded once (all missing ones in parallel), unpacked once per session


def _cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_FP4_SDIST_CACHE", Path.home() / ".cache" / "megatron_fp4" / "sdists"))


def _cached(cache: Path, version: str):
    found = sorted(cache.glob(f"megatron[-_]core-{version}.tar.gz"))
    return found[0] if found else None


@pytest.fixture(scope="session")
def sdists():
    """{version: path of its .tar.gz} for every release line's made_against version."""
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    versions = sorted({line.made_against for line in patching.RELEASE_LINES})
    jobs = {}
    for version in versions:
        if _cached(cache, version) is None:
            # --no-binary megatron-core, not :all: (which would also build setuptools and pybind11, the
            # sdist's build requirements, from source: minutes on a cold pip cache, instead of seconds).
            command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                       "--no-binary", "megatron-core", f"megatron-core=={version}", "-d", str(cache)]
            jobs[version] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failures = []
    for version, job in jobs.items():
        try:
            output, _ = job.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            job.kill()
            output = "timed out after 300 s"
        if job.returncode != 0 or _cached(cache, version) is None:
            failures.append(f"megatron-core=={version}: {output.strip()[-500:]}")
    if failures:
        message = "could not download megatron-core sdists: " + "; ".join(failures)
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return {version: _cached(cache, version) for version in versions}


@pytest.fixture(scope="session")
def pristine(sdists, tmp_path_factory):
    """pristine(version) -> an unpacked tree (megatron/ only); shared: copy it before changing it."""
    trees = {}

    def get(version: str) -> Path:
        if version not in trees:
            root = tmp_path_factory.mktemp(f"megatron-core-{version}")
            with tarfile.open(sdists[version]) as archive:
                members = []
                for member in archive.getmembers():
                    parts = member.name.split("/", 1)
                    if len(parts) == 2 and parts[1].startswith("megatron/"):
                        member.name = parts[1]
                        members.append(member)
                archive.extractall(root, members=members, filter="data")
            trees[version] = root
        return trees[version]

    return get


def _copy(tree: Path, where: Path) -> Path:
    target = where / "tree"
    shutil.copytree(tree, target)
    return target


def _hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def _run(capsys, *argv):
    """The CLI function itself (megatron_fp4.patching.main is `megatron-fp4 patch ...`)."""
    code = patching.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _changed(before: dict, after: dict) -> set:
    return {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}


def _expected_files(line, tree: Path) -> set:
    return {fp.path for part in patching.load_parts(line)
            if part.name == "core" or (tree / "megatron" / "training").is_dir() for fp in part.files}


# ----------------------------------------------------------------------------------------------------
# Version detection and release lines (no network)


def _fake_tree(root: Path, info: str) -> Path:
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(textwrap.dedent(info))
    return root


def test_version_detection(tmp_path):
    tree = _fake_tree(tmp_path / "a", """
        # Copyright
        MAJOR = 0
        MINOR = 19
        PATCH = 2
        PRE_RELEASE = ""

        VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
        __version__ = ".".join(map(str, VERSION[:3])) + "".join(VERSION[3:])
    """)
    version = patching.detect_version(tree)
    assert version == patching.MegatronVersion(0, 19, 2, "")
    assert (str(version), version.line) == ("0.19.2", (0, 19))
    assert patching.release_line_for(version).name == "core_r0.19"

    rc = _fake_tree(tmp_path / "b", "MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = 'rc1'\n")
    assert str(patching.detect_version(rc)) == "0.20.0rc1"

    with pytest.raises(patching.PatchError, match="megatron/core/package_info.py does not exist"):
        patching.detect_version(tmp_path)
    with pytest.raises(patching.PatchError, match=r"give its root, .*/a \(the folder that holds megatron/\)"):
        patching.detect_version(tree / "megatron")
    with pytest.raises(patching.PatchError, match="give its root"):
        patching.detect_version(tree / "megatron" / "core")
    bad = _fake_tree(tmp_path / "c", "MAJOR = 0\nMINOR = '19'\n")
    with pytest.raises(patching.PatchError, match="does not set MAJOR, MINOR and PATCH to integers"):
        patching.detect_version(bad)
    with pytest.raises(patching.PatchError, match="is not a folder"):
        patching.detect_version(tmp_path / "nothing-here")


def test_release_lines():
    for version, name in [((0, 18, 0), "core_r0.18"), ((0, 18, 2), "core_r0.18"), ((0, 19, 0), "core_r0.19"),
                          ((0, 19, 2), "core_r0.19")]:
        assert patching.release_line_for(patching.MegatronVersion(*version)).name == name
    # 0.15 and 0.17 had patch sets once; the plugin refuses them now, so they have none.
    for unsupported in ((0, 15, 3), (0, 16, 1), (0, 17, 1), (0, 20, 0)):
        with pytest.raises(patching.PatchError) as refused:
            patching.release_line_for(patching.MegatronVersion(*unsupported))
        message = str(refused.value)
        version = ".".join(map(str, unsupported))
        assert f"megatron-core {version} (release line core_r0.{unsupported[1]}) has no patch here" in message
        for line in patching.RELEASE_LINES:
            assert f"{line.name} ({line.version[0]}.{line.version[1]}.x)" in message
    for name in ("core_r0.19", "0.19", "0.19.x"):
        assert patching.release_line_named(name).name == "core_r0.19"
    for name in ("core_r0.16", "core_r0.17"):
        with pytest.raises(patching.PatchError, match=f"no patch set '{name}'"):
            patching.release_line_named(name)


def test_release_lines_are_the_plugins_supported_range():
    """A patch set for every release line the plugin accepts, and for no other."""
    from megatron_fp4.options import SUPPORTED_MEGATRON_CORE

    (major, low), (high_major, high) = SUPPORTED_MEGATRON_CORE
    assert major == high_major
    assert [line.version for line in patching.RELEASE_LINES] == [(major, minor) for minor in range(low, high + 1)]
    assert sorted(p.name for p in patching.PATCH_DIR.iterdir() if p.is_dir()) == [l.name for l in patching.RELEASE_LINES]


def test_patch_sets_are_small_and_touch_only_the_expected_files():
    for line in patching.RELEASE_LINES:
        parts = {part.name: part for part in patching.load_parts(line)}
        assert set(parts) == {"core", "training"}, line.name
        assert [fp.path for fp in parts["core"].files] == [MOE_LAYER]
        assert {fp.path for fp in parts["training"].files} <= {ARGUMENTS, ARGUMENT_UTILS}
        for part in parts.values():
            for fp in part.files:
                body = [(tag, text) for hunk in fp.hunks for tag, text in hunk.lines]
                assert sum(tag == "-" for tag, _ in body) <= 1, (line.name, fp.path)  # adds; changes 1 line at most
                assert sum(tag == "+" for tag, _ in body) <= 25, (line.name, fp.path)
                assert max(len(text) for _, text in body) <= 100  # Megatron's line length
                added = "\n".join(text for tag, text in body if tag == "+")
                assert "megatron_fp4" in added


def test_the_repositorys_patches_folder_points_at_the_packaged_patch_sets():
    repo_patches = Path(__file__).resolve().parents[2] / "patches"
    for line in patching.RELEASE_LINES:
        assert (repo_patches / line.name).resolve() == patching.PATCH_DIR / line.name
        assert (repo_patches / line.name / "core.patch").is_file()


def test_patch_command_is_registered_like_the_other_subcommands():
    parser = argparse.ArgumentParser(prog="megatron-fp4")
    patching.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["patch", "apply", "/some/tree", "--line", "0.19"])
    assert (args.patch_action, args.path, args.line) == ("apply", "/some/tree", "0.19") and callable(args.run)
    with pytest.raises(SystemExit):
        parser.parse_args(["patch"])


def test_megatron_fp4_cli_runs_patch_list(capsys):
    from megatron_fp4 import cli

    missing = [name for name in cli.SUBCOMMAND_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"megatron_fp4.cli's other subcommand modules are not there yet: {missing}")
    assert cli.main(["patch", "list"]) == 0
    out = capsys.readouterr().out
    for line in patching.RELEASE_LINES:
        assert str(patching.PATCH_DIR / line.name / "core.patch") in out


def test_unsupported_release_and_not_a_tree(tmp_path, capsys):
    tree = _fake_tree(tmp_path / "old", "MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ''\n")
    code, out = _run(capsys, "check", tree)
    assert code == 2
    assert "megatron-core 0.16.1 (release line core_r0.16) has no patch here" in out
    assert "core_r0.18 (0.18.x)" in out and "core_r0.19 (0.19.x)" in out
    code, out = _run(capsys, "apply", tmp_path)
    assert code == 2 and "is not a Megatron-LM or megatron-core source tree" in out


def test_an_older_tree_is_told_to_upgrade_on_every_route(tmp_path, capsys):
    """A 0.17 tree was sent to the plugin route (which refuses megatron-core < 0.18) or to --line
    0.18 (whose patch conflicts, and whose patched tree would refuse the release at start-up): the
    one advice that works is a supported release, --line or not."""
    from megatron_fp4.options import Environment, FP4Options, ModelSettings, Route, UnsupportedConfiguration, validate

    tree = _fake_tree(tmp_path / "old", "MAJOR = 0\nMINOR = 17\nPATCH = 1\nPRE_RELEASE = ''\n")
    before = _hashes(tree)
    upgrade = ("megatron_fp4 refuses any other release on every route (patch, plugin, launcher): upgrade this tree "
               "to Megatron-LM / megatron-core 0.18 or 0.19, then run the command again.")
    for argv in (("apply", tree), ("check", tree), ("apply", tree, "--line", "0.18"), ("check", tree, "--line",
                                                                                        "core_r0.19")):
        code, out = _run(capsys, *argv)
        assert code == 2, argv
        assert out.startswith("error: megatron-core 0.17.1 (release line core_r0.17) has no patch here. ")
        assert out.endswith(upgrade + "\n") and out.count("\n") == 1, out
        assert "plugin route (" not in out and "--line" not in out
    assert _hashes(tree) == before
    # What the old advice sent people to: the plugin and the patch route both refuse 0.17.
    for route in (Route.PLUGIN, Route.PATCH):
        with pytest.raises(UnsupportedConfiguration, match="found 0.17.1: install a supported megatron-core"):
            validate(FP4Options(dispatch=True), ModelSettings.from_args(SimpleNamespace(
                num_experts=8, moe_token_dispatcher_type="alltoall", hidden_size=256)),
                Environment("0.17.1", True, (9, 0)), route)
    newer = _fake_tree(tmp_path / "new", "MAJOR = 0\nMINOR = 20\nPATCH = 0\nPRE_RELEASE = 'rc1'\n")
    code, out = _run(capsys, "check", newer)
    assert code == 2 and "move this tree to Megatron-LM / megatron-core 0.18 or 0.19" in out


# ----------------------------------------------------------------------------------------------------
# The diff engine on small texts (no network)

_TEXT = "".join(f"line {i}\n" for i in range(1, 21))
_PATCH = """Some description that patch and git apply skip.
--- a/f.txt
+++ b/f.txt
@@ -4,3 +4,4 @@ def where
 line 4
 line 5
+inserted after 5
 line 6
@@ -14,3 +15,3 @@
 line 14
-line 15
+line fifteen
 line 16
"""


def _fp():
    (fp,) = unified_diff.parse(_PATCH)
    return fp


def test_engine_applies_at_an_offset_and_knows_when_it_is_already_applied():
    fp = _fp()
    assert fp.path == "f.txt" and [h.header for h in fp.hunks] == ["@@ -4,3 +4,4 @@ def where", "@@ -14,3 +15,3 @@"]
    shifted = "extra\nextra\n" + _TEXT  # every line two lines further down
    result = unified_diff.check_text(shifted, fp)
    assert result.status == APPLIES and [h.offset for h in result.hunks] == [2, 2]
    assert "line 5\ninserted after 5\nline 6\n" in result.new_text and "line fifteen\n" in result.new_text
    again = unified_diff.check_text(result.new_text, fp)
    assert again.status == APPLIED and again.new_text is None
    back = unified_diff.check_text(result.new_text, fp.reversed())
    assert back.status == APPLIES and back.new_text == shifted


def test_engine_diagnoses_a_conflict_and_a_partial_application():
    changed = _TEXT.replace("line 15\n", "line 15 (edited)\n")
    result = unified_diff.check_text(changed, _fp())
    assert result.status == CONFLICT
    first, second = result.hunks
    assert first.status == APPLIES and second.status == CONFLICT
    assert (second.mismatch.line, second.mismatch.agree, second.mismatch.total) == (14, 2, 3)
    assert second.mismatch.differences == [(15, "line 15", "line 15 (edited)")]
    half = _TEXT.replace("line 15\n", "line fifteen\n")  # the second hunk only
    assert unified_diff.check_text(half, _fp()).status == "partly"


def test_engine_keeps_crlf_and_rejects_malformed_patches():
    result = unified_diff.check_text(_TEXT.replace("\n", "\r\n"), _fp())
    assert result.status == APPLIES and "line 5\r\ninserted after 5\r\n" in result.new_text
    assert result.new_text.count("\n") == result.new_text.count("\r\n") == 21
    for broken, message in [("nothing\n", "no unified diff"),
                            (_PATCH.replace("@@ -14,3 +15,3 @@", "@@ -14,4 +15,4 @@"), "fewer lines|ends early"),
                            (_PATCH.replace("@@ -4,3", "@@ -x,3"), "unreadable hunk header")]:
        with pytest.raises(unified_diff.PatchFormatError, match=message):
            unified_diff.parse(broken)


# ----------------------------------------------------------------------------------------------------
# Each release line on its megatron-core sdist


@pytest.mark.parametrize("line_name", sorted(LINES))
def test_check_apply_reapply_revert(line_name, pristine, tmp_path, capsys):
    line = LINES[line_name]
    tree = _copy(pristine(line.made_against), tmp_path)
    assert (tree / "megatron" / "training").is_dir()  # the sdists of the supported lines ship it
    assert patching.detect_version(tree) == patching.MegatronVersion(*map(int, line.made_against.split(".")))
    original = _hashes(tree)

    # The patch files are ordinary unified diffs: GNU patch and git apply accept them too.
    for part in patching.load_parts(line):
        for tool in (["patch", "--dry-run", "--force", "-p1", "-i"], ["git", "apply", "--check", "-p1"]):
            if shutil.which(tool[0]):
                done = subprocess.run(tool + [str(part.path)], cwd=tree, capture_output=True, text=True)
                assert done.returncode == 0, (tool[0], part.path, done.stdout + done.stderr)

    code, out = _run(capsys, "check", tree)
    assert code == 0, out
    assert f"megatron-core {line.made_against}; using the {line.name} patch set" in out
    assert "core part (core.patch): applies cleanly" in out and "Check passed" in out
    assert "training part (training.patch): applies cleanly" in out
    assert _hashes(tree) == original

    code, out = _run(capsys, "apply", tree)
    assert code == 0 and "Applied: changed " in out, out
    patched = _hashes(tree)
    assert _changed(original, patched) == _expected_files(line, tree)
    moe = (tree / MOE_LAYER).read_text()
    assert 'fp4_dispatch = getattr(config, "moe_fp4_dispatch", False)' in moe
    assert 'elif config.moe_token_dispatcher_type == "alltoall" and fp4_dispatch:' in moe
    assert "options=FP4Options.from_config(config), route=Route.PATCH," in moe
    for name in _changed(original, patched):
        compile((tree / name).read_text(), name, "exec")
    assert "parser = add_arguments(parser)" in (tree / ARGUMENTS).read_text()
    (config_file,) = [name for name in (ARGUMENTS, ARGUMENT_UTILS) if (tree / name).is_file()
                      and "def core_transformer_config_from_args" in (tree / name).read_text()]
    assert "setattr(config, name, value)" in (tree / config_file).read_text()

    for action in ("apply", "check"):
        code, out = _run(capsys, action, tree)
        assert code == 0 and "Already applied: the patch is in this tree; nothing to do." in out, out
        assert "CONFLICT" not in out
    assert _hashes(tree) == patched

    code, out = _run(capsys, "revert", tree)
    assert code == 0 and "Reverted: changed " in out, out
    assert _hashes(tree) == original
    code, out = _run(capsys, "revert", tree)
    assert code == 0 and "nothing to revert" in out


def test_conflicts_are_explained_in_plain_words(pristine, tmp_path, capsys):
    line = LINES["core_r0.19"]
    tree = _copy(pristine(line.made_against), tmp_path)
    moe = tree / MOE_LAYER
    stock = '        elif config.moe_token_dispatcher_type == "alltoall":'
    edited = '        elif config.moe_token_dispatcher_type in ("alltoall",):  # a fork\'s edit'
    moe.write_text(moe.read_text().replace(stock, edited))
    before = _hashes(tree)

    for action in ("check", "apply"):
        code, out = _run(capsys, action, tree)
        assert code == 1, out
        assert "core part (core.patch): CONFLICT" in out
        assert f"CONFLICT in {MOE_LAYER}, hunk 2 of 2 [@@ -303,6 +305,17 @@ def __init__(]:" in out
        assert f"expected  {stock}" in out and f"found     {edited}" in out
        assert "Likely reason: the file is not as in megatron-core 0.19.2: it was modified locally" in out
        assert "training part (training.patch): applies cleanly" in out
        assert "Nothing was changed" in out
        assert _hashes(tree) == before

    # Another release line's patch set (--line): its training part does not fit 0.19's files.
    code, out = _run(capsys, "check", tree, "--line", "core_r0.18")
    assert code == 1
    assert "using the core_r0.18 patch set (--line)" in out
    assert f"CONFLICT in {ARGUMENT_UTILS}" in out
    assert "you chose the core_r0.18 patch set (--line): the lines differ between these releases" in out

    # A partial application: one file of the training part patched, the other not.
    fresh = _copy(pristine(line.made_against), tmp_path / "partial")
    assert _run(capsys, "apply", fresh)[0] == 0
    shutil.copy(pristine(line.made_against) / ARGUMENT_UTILS, fresh / ARGUMENT_UTILS)
    code, out = _run(capsys, "apply", fresh)
    assert code == 1
    assert "core part (core.patch): already applied" in out
    assert f"{ARGUMENTS}: already patched." in out and f"{ARGUMENT_UTILS}: not patched, and the patch fits it." in out
    assert "the training part was applied to some of its files only" in out


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_conflict_in_a_git_checkout_names_local_changes(pristine, tmp_path, capsys):
    source = pristine(LINES["core_r0.19"].made_against)
    tree = tmp_path / "checkout"
    for name in ("megatron/core/package_info.py", MOE_LAYER):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / name, tree / name)
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "stock"]):
        subprocess.run(git + command, check=True, capture_output=True)
    moe = tree / MOE_LAYER
    moe.write_text(moe.read_text().replace("        # Initialize token dispatcher\n", "        # Our dispatcher\n"))
    code, out = _run(capsys, "check", tree)
    assert code == 1
    assert f"CONFLICT in {MOE_LAYER}, hunk 1 of 2" in out
    assert "expected          # Initialize token dispatcher" in out and "found             # Our dispatcher" in out
    assert "Likely reason: git shows local changes in this file" in out
    assert "training part (training.patch): skipped" in out


# ----------------------------------------------------------------------------------------------------
# The patched trees work (subprocess, PYTHONPATH=tree)

_PROBE = r'''
import json, os, sys
tree, store = sys.argv[1], sys.argv[2]
report = {}


class HideMegatronFp4:
    """Makes `import megatron_fp4` fail exactly as when it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron_fp4" or name.startswith("megatron_fp4."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


hide = HideMegatronFp4()
sys.meta_path.insert(0, hide)

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
from megatron.core import parallel_state

parallel_state.initialize_model_parallel()
import megatron.core.transformer.moe.moe_layer as moe_layer
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

report["moe_layer_file"] = moe_layer.__file__


class Stop(Exception):
    pass


built = []


def recorder(name):
    def build(*args, **kwargs):
        options = kwargs.get("options")
        built.append([name, options and {"scale_rule": str(options.scale_rule), "dispatch_grad": str(options.dispatch_grad)}])
        raise Stop  # the rest of the layer (experts) is not what this test is about

    return build


moe_layer.MoEAlltoAllTokenDispatcher = recorder("stock")


def build_layer(**fp4):
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=4,
                               moe_ffn_hidden_size=128, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                               add_bias_linear=False, use_cpu_initialization=True)
    for key, value in fp4.items():
        setattr(config, key, value)
    spec = get_gpt_layer_local_spec(num_experts=4).submodules.mlp
    try:
        spec(config=config) if not isinstance(spec, ModuleSpec) else build_module(spec, config=config)
    except Stop:
        pass
    return built[-1]


has_training = os.path.isdir(os.path.join(tree, "megatron", "training"))
base = ["pretrain", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--num-experts", "4",
        "--moe-token-dispatcher-type", "alltoall", "--ffn-hidden-size", "512", "--no-rope-fusion"]
fp4_flags = ["--moe-fp4-dispatch", "--moe-fp4-scale-rule", "floor", "--moe-fp4-dispatch-grad", "fp8"]


def parse(argv, **kwargs):
    from megatron.training.arguments import parse_args

    sys.argv = argv
    args = parse_args(**kwargs)
    args.params_dtype = torch.float32  # validate_args would set it
    return args


def fp4_items(namespace):
    return {k: v for k, v in sorted(vars(namespace).items()) if k.startswith("moe_fp4")}


# 1. megatron_fp4 not installed: stock Megatron.
report["stock_layer"] = build_layer()
if has_training:
    from megatron.training.arguments import core_transformer_config_from_args
    import megatron.training.arguments as arguments

    report["arguments_file"] = arguments.__file__
    args = parse(base)
    report["hidden_args"] = fp4_items(args)
    report["hidden_config"] = fp4_items(core_transformer_config_from_args(args))
    try:
        parse(base + fp4_flags)
        report["hidden_flag"] = "accepted"
    except SystemExit as exit:
        report["hidden_flag"] = f"exit {exit.code}"

# 2. megatron_fp4 installed.
sys.meta_path.remove(hide)
import megatron_fp4.dispatch.token_dispatcher as token_dispatcher

token_dispatcher.FP4AlltoAllTokenDispatcher = recorder("fp4")
report["fp4_layer"] = build_layer(moe_fp4_dispatch=True, moe_fp4_scale_rule="floor", moe_fp4_dispatch_grad="fp8")
report["off_layer"] = build_layer(moe_fp4_dispatch=False)
if has_training:
    from megatron_fp4.options import UnsupportedConfiguration, add_arguments

    torch.cuda.is_available = lambda: True  # the refusals check for GPUs; this is a CPU test
    torch.cuda.get_device_capability = lambda *device: (9, 0)  # a Hopper GPU, as far as they can tell
    args = parse(base + fp4_flags)
    report["args"] = fp4_items(args)
    report["config"] = fp4_items(core_transformer_config_from_args(args))
    report["default_args"] = fp4_items(parse(base))
    report["launcher_args"] = fp4_items(parse(base + fp4_flags, extra_args_provider=add_arguments))
    try:
        core_transformer_config_from_args(parse(base + fp4_flags + ["--moe-token-dispatcher-type", "allgather"]))
        report["refusal"] = None
    except UnsupportedConfiguration as error:
        report["refusal"] = str(error)
print("REPORT " + json.dumps(report))
'''


@pytest.mark.parametrize("line_name", ["core_r0.19", "core_r0.18"])
def test_patched_tree_imports_and_picks_the_dispatcher(line_name, pristine, tmp_path, capsys):
    line = LINES[line_name]
    tree = _copy(pristine(line.made_against), tmp_path)
    assert _run(capsys, "apply", tree)[0] == 0
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(probe), str(tree), str(tmp_path / "store")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    reports = [row for row in done.stdout.splitlines() if row.startswith("REPORT ")]
    assert done.returncode == 0 and reports, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(reports[-1][len("REPORT "):])

    assert report["moe_layer_file"] == str(tree / MOE_LAYER)
    assert report["stock_layer"] == ["stock", None]
    assert report["off_layer"] == ["stock", None]
    assert report["fp4_layer"] == ["fp4", {"scale_rule": "floor", "dispatch_grad": "fp8"}]
    fp4 = {"moe_fp4_dispatch": True, "moe_fp4_dispatch_grad": "fp8", "moe_fp4_scale_rule": "floor"}
    assert report["arguments_file"] == str(tree / ARGUMENTS)
    assert report["hidden_args"] == {} and report["hidden_config"] == {}
    assert report["hidden_flag"] == "exit 2"  # argparse: unrecognized arguments
    # Every moe_fp4_* argument reaches the config (whatever flags add_arguments has by now).
    assert report["config"] == report["args"] == report["launcher_args"]
    assert {key: report["args"][key] for key in fp4} == fp4
    default = report["default_args"]
    assert (default["moe_fp4_dispatch"], default["moe_fp4_dispatch_grad"], default["moe_fp4_scale_rule"]) == (
        False, "bf16", "ceil")
    assert "--moe-token-dispatcher-type alltoall" in report["refusal"]
