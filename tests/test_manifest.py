from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from providers import write_provider

from resident_pool import ManifestError
from resident_pool.providers.manifest import PLACEHOLDERS, json_schema, load_manifest, load_manifests

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_manifests_load():
    manifests = load_manifests(ROOT / "manifests")
    assert {"minilm", "echo"} <= set(manifests)
    minilm = manifests["minilm"]
    assert minilm.weights.root_env == "MINILM_WEIGHTS" and len(minilm.weights.files) >= 2
    assert minilm.worker_path.is_file()


def test_the_gpu_example_is_valid_and_not_picked_up_as_a_provider():
    example = load_manifest(ROOT / "manifests" / "_examples" / "boltz2" / "manifest.toml")
    assert example.gpu.policy == "required" and example.gpu.vram_budget_gb > 0
    assert example.kit is not None and example.kit.levers_off and example.kit.env
    assert "boltz2" not in load_manifests(ROOT / "manifests")
    protein = load_manifest(ROOT / "manifests" / "_examples" / "esm2" / "manifest.toml")
    assert protein.inputs.kinds == ["protein"] and protein.answers.embedding == "embedding"
    assert protein.answers.relations and "esm2" not in load_manifests(ROOT / "manifests")


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ('[gpu]\npolicy = "required"\n', "gpu", "vram_budget_gb is required"),
        ('[gpu]\npolicy = "recommended"\n', "gpu", "vram_budget_gb is required"),
        ('colour = "blue"\n', "colour", "Extra inputs are not permitted"),
        ('[lifecycle]\nidle_timeout = 5\n', "lifecycle.idle_timeout", "Extra inputs"),
        ('worker_args = ["{socket}", "{weights}"]\n', "worker_args", "{weights} in"),
        ('mode = "subprocess"\n', "(top level)", "mode_reason"),
        ('[inputs]\nkinds = ["protein", "dna"]\n', "inputs.kinds.1", "'protein' or 'text'"),
        ('[inputs]\nkinds = []\n', "inputs.kinds", "at least 1 item"),
        ('[inputs]\nkinds = ["text", "text"]\n', "inputs.kinds", "names a kind twice"),
        ('[inputs.protein]\nU = "J"\n', "inputs.protein.U", "'accept', 'refuse'"),
        ('[inputs.protein]\n"*" = "ignore"\n', "inputs.protein.*", "'trailing', 'refuse' or 'accept'"),
        ('[inputs.protein]\nJ = "accept"\n', "inputs.protein.J", "Extra inputs"),
        ('[answers]\nembedding = "items.0"\n', "answers.embedding", "the name of an answer item's field"),
        ('[answers]\nchecks = ["distinct", "golden"]\n', "answers.checks.1", "'distinct', 'finite'"),
        ('[answers]\ndistinct_cosine = 1.5\n', "answers.distinct_cosine", "less than or equal to 1"),
        ('[smoke]\ninputs = "../elsewhere.fasta"\n', "smoke.inputs", "relative to the manifest, without '..'"),
        ('[kit]\nname = "boltz"\nmode = "fast"\nenv_row = "none"\n', "kit", "env_row_reason"),
        ('[lifecycle]\nmax_replicas = 0\n', "lifecycle.max_replicas", "greater than or equal to 1"),
        ('[[weights.files]]\npath = "../etc/passwd"\nsha256 = "' + "0" * 64 + '"\nsize = 1\n', "weights.files.0.path", "'..'"),
        ('[env]\nkind = "container"\nengine = "lxc"\nimage = "x"\n', "env.engine", "apptainer"),
    ],
)
def test_each_mistake_names_the_file_and_the_field(tmp_path, body, field, words):
    path = write_provider(tmp_path, "bad", body)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    message = str(info.value)
    assert str(path) in message
    assert f"{field}:" in message
    assert words in message
    assert info.value.details["field"] == field


def test_a_missing_worker_script_is_named(tmp_path):
    path = write_provider(tmp_path, "noscript", "")
    (path.parent / "worker.py").unlink()
    with pytest.raises(ManifestError, match=r"worker: the script .*worker\.py does not exist") as info:
        load_manifest(path)
    assert str(path) in str(info.value)


def test_bad_toml_names_the_file_and_line(tmp_path):
    path = write_provider(tmp_path, "toml", "[gpu\n")
    with pytest.raises(ManifestError, match="not valid TOML") as info:
        load_manifest(path)
    assert str(path) in str(info.value) and "line 3" in str(info.value)


def test_slug_must_match_its_folder(tmp_path):
    path = write_provider(tmp_path, "folder", "")
    path.write_text(path.read_text().replace('slug = "folder"', 'slug = "other"'))
    with pytest.raises(ManifestError, match="differs from its folder"):
        load_manifest(path)


def test_every_placeholder_is_accepted(tmp_path):
    args = json.dumps([f"{{{name}}}" for name in sorted(PLACEHOLDERS)])
    manifest = load_manifest(write_provider(tmp_path, "all", f"worker_args = {args}\n"))
    assert len(manifest.worker_args) == len(PLACEHOLDERS)


def test_fingerprint_follows_the_pins(tmp_path):
    pin = '[[weights.files]]\npath = "w.bin"\nsha256 = "{}"\nsize = 1\n'
    first = load_manifest(write_provider(tmp_path, "fp", pin.format("a" * 64)))
    second = load_manifest(write_provider(tmp_path, "fp", pin.format("b" * 64)))
    assert first.fingerprint() != second.fingerprint()


def test_the_input_rule_is_part_of_the_version_and_what_the_answers_mean_is_not(tmp_path):
    """[inputs] decides what is sent (a final '*' dropped, U read as C): a campaign's stored answers under another
    rule are not its answers. [answers] only judges them."""
    plain = load_manifest(write_provider(tmp_path / "a", "model", ""))
    ruled = load_manifest(write_provider(tmp_path / "b", "model", '[inputs]\nkinds = ["protein"]\n'))
    replaced = load_manifest(write_provider(tmp_path / "c", "model", '[inputs]\nkinds = ["protein"]\n'
                                                                      '[inputs.protein]\nU = "C"\n'))
    judged = load_manifest(write_provider(tmp_path / "d", "model", '[answers]\nembedding = "embedding"\n'))
    assert len({plain.version(), ruled.version(), replaced.version()}) == 3
    assert judged.version() == plain.version()
    assert plain.inputs.kinds == ["text"]  # a provider that declares nothing takes free text, as before


def test_schema_is_exported_by_the_cli():
    done = subprocess.run([sys.executable, "-m", "resident_pool", "schema"], capture_output=True, text=True, check=True)
    schema = json.loads(done.stdout)
    assert schema == json.loads(json.dumps(json_schema()))
    assert {"slug", "worker", "gpu", "kit", "weights", "lifecycle"} <= set(schema["properties"])
    assert "path" not in schema["properties"]


_VERSION = "import sys; from resident_pool.providers.manifest import load_manifest; print(load_manifest(sys.argv[1]).version())"


def _version_under(python: str | Path, manifest: Path, **env: str) -> str:
    import os

    done = subprocess.run([str(python), "-c", _VERSION, str(manifest)], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}, timeout=60)
    return done.stdout.strip()


def test_python_auto_version_is_the_same_whichever_path_reaches_the_interpreter(tmp_path):
    """Review of issue 15, finding 2: a pool started by .venv/bin/python3 and a flow run by .venv/bin/python (or
    through a symlinked folder) compute one version; a campaign's results are not all 'version_changed'."""
    manifest = write_provider(tmp_path, "auto", "")
    here = Path(sys.executable)
    other = here.with_name("python3" if here.name != "python3" else "python")
    assert other.exists() and other != here
    linked = tmp_path / "linked-venv"
    linked.symlink_to(Path(sys.prefix), target_is_directory=True)
    through_link = linked / here.relative_to(sys.prefix)
    versions = {_version_under(python, manifest) for python in (here, other, through_link)}
    assert versions == {load_manifest(manifest).version()}, versions


def test_python_auto_version_differs_in_another_environment(tmp_path):
    """Another venv (other packages) is another interpreter for "auto": its answers may differ."""
    manifest = write_provider(tmp_path, "auto", "")
    import os

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    # This process's import path (this checkout and its packages): the same code, another environment.
    other = _version_under(tmp_path / "venv" / "bin" / "python", manifest,
                           PYTHONPATH=os.pathsep.join(entry for entry in sys.path if entry))
    assert other != load_manifest(manifest).version()
