"""Spec files (issue 26, item 4): YAML, JSON and TOML by extension; a file that does not
parse names the file, the line and the column, and exits 2 from the CLI and the job
entrypoint; a JSON body that does not parse is a 422 naming its line and column. Also
item 8's serializer warning and the dashboard's model name.

Every broken file below is broken at one known place, and the expected line and column
are counted by hand from the text (lines and columns from 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from helpers.service_http import ROOT, Service

from service.control.cli.commands import main as cli_main
from service.job.spec import load_spec, parse_spec
from service.job.spec.spec_files import SpecFileError, position, read_spec_file

# a flow mapping opened on line 3 (its "{" in column 9) and never closed: PyYAML's
# ParserError at the ":" after "steps" (line 4, column 6)
BROKEN_YAML = ("name: broken-yaml\n"
               "model: tiny\n"
               "layout: {replicate: 2, shard: 2\n"
               "steps: 5\n")
# no comma after line 4: the next key's quote, line 5, column 3
BROKEN_JSON = ('{\n'
               '  "name": "broken-json",\n'
               '  "model": "tiny",\n'
               '  "steps": 5\n'
               '  "seq_len": 32\n'
               '}\n')
# a bare word as a value: "two" starts at line 7, column 9
BROKEN_TOML = ('name = "broken-toml"\n'
               'model = "tiny"\n'
               'steps = 5\n'
               '\n'
               '[layout]\n'
               'replicate = 2\n'
               'shard = two\n')
VALID_TOML = ('name = "from-toml"\n'
              'model = "tiny"\n'
              'steps = 5\n'
              'seq_len = 32\n'
              '\n'
              '[layout]\n'
              'replicate = 2\n'
              'shard = 2\n'
              '\n'
              '[optimizer]\n'
              'lr = 0.01\n'
              'adamw_betas = [0.9, 0.99]\n'
              '\n'
              '[data]\n'
              'val_every = 0\n')
VALID_DATA = {"name": "from-toml", "model": "tiny", "steps": 5, "seq_len": 32,
              "layout": {"replicate": 2, "shard": 2},
              "optimizer": {"lr": 0.01, "adamw_betas": [0.9, 0.99]},
              "data": {"val_every": 0}}
# (file name, text, line, column, format)
BROKEN = [("job.yaml", BROKEN_YAML, 4, 6, "YAML"),
          ("job.json", BROKEN_JSON, 5, 3, "JSON"),
          ("job.toml", BROKEN_TOML, 7, 9, "TOML")]
BROKEN_IDS = ["yaml", "json", "toml"]


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def _names_the_place(stderr: str, path, line: int, column: int, fmt: str) -> None:
    assert f"error: {path}: line {line}, column {column}: not valid {fmt}: " in stderr, stderr
    assert "Traceback" not in stderr, stderr


# -- the reader ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,text,line,column,fmt", BROKEN, ids=BROKEN_IDS)
def test_a_broken_file_names_its_line_and_column(tmp_path, name, text, line, column, fmt):
    path = _write(tmp_path, name, text)
    with pytest.raises(SpecFileError) as e:
        read_spec_file(path)
    assert (e.value.path, e.value.line, e.value.column) == (str(path), line, column)
    assert str(e.value).startswith(f"{path}: line {line}, column {column}: not valid {fmt}: ")


def test_the_yaml_error_also_names_where_the_open_mapping_starts(tmp_path):
    with pytest.raises(SpecFileError) as e:
        read_spec_file(_write(tmp_path, "job.yml", BROKEN_YAML))
    assert "(while parsing a flow mapping at line 3, column 9)" in str(e.value)


def test_a_toml_file_is_toml(tmp_path):
    path = _write(tmp_path, "job.toml", VALID_TOML)
    assert read_spec_file(path) == VALID_DATA
    assert load_spec(path) == parse_spec(VALID_DATA)
    # the same spec as JSON and YAML reads the same
    assert load_spec(_write(tmp_path, "job.json", json.dumps(VALID_DATA))) == load_spec(path)
    assert load_spec(_write(tmp_path, "job.YAML", json.dumps(VALID_DATA))) == load_spec(path)


@pytest.mark.parametrize("name,raw,line,column,problem", [
    # TOML's "end of document": the place just past the last character
    ("job.toml", b'name = "x"\nsteps = [5,', 2, 12, "not valid TOML: Invalid value"),
    # a control character YAML refuses: "\x01" is line 2's 7th character
    ("job.yaml", b"name: x\nseed: \x01\n", 2, 7,
     "not valid YAML: character U+0001: special characters"),
    # Latin-1, not UTF-8: the 0xe9 byte follows 10 characters of line 1
    ("job.yaml", b'name: "caf\xe9"\n', 1, 11, "not UTF-8: byte 0xe9"),
    ("job.json", b"", 1, 1, "not valid JSON: Expecting value"),
])
def test_other_places_a_file_breaks(tmp_path, name, raw, line, column, problem):
    path = tmp_path / name
    path.write_bytes(raw)
    with pytest.raises(SpecFileError) as e:
        read_spec_file(path)
    assert (e.value.line, e.value.column) == (line, column)
    assert str(e.value).startswith(f"{path}: line {line}, column {column}: {problem}")


def test_position_counts_from_one():
    text = "ab\ncd\n"
    assert [position(text, i) for i in range(len(text) + 1)] == [
        (1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (3, 1)]


@pytest.mark.parametrize("name,text,message", [
    ("job.txt", "model: tiny\n", "unknown spec format '.txt'"),
    ("job.yaml", "- model: tiny\n", "a job spec is a mapping of fields, the YAML file holds "
                                    "a list"),
    ("job.json", "[1]", "the JSON file holds a list"),
])
def test_unknown_extensions_and_non_mappings_are_refused(tmp_path, name, text, message):
    with pytest.raises(SpecFileError, match=message):
        read_spec_file(_write(tmp_path, name, text))


def test_an_empty_yaml_or_toml_file_is_every_default(tmp_path):
    assert load_spec(_write(tmp_path, "a.yaml", "")) == parse_spec({})
    assert load_spec(_write(tmp_path, "a.toml", "")) == parse_spec({})


# -- the CLI and the entrypoint --------------------------------------------------------------
def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "service.control.cli", *args], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("command", ["plan", "submit"])
@pytest.mark.parametrize("name,text,line,column,fmt", BROKEN, ids=BROKEN_IDS)
def test_the_cli_exits_2_naming_the_place(tmp_path, command, name, text, line, column, fmt):
    path = _write(tmp_path, name, text)
    # nothing answers at this URL: the file is refused before any request
    proc = _cli(command, str(path), DMUON_URL="http://127.0.0.1:9")
    assert proc.returncode == 2, proc.stderr
    _names_the_place(proc.stderr, path, line, column, fmt)
    assert proc.stdout == ""


def _entrypoint(tmp_path, spec):
    return subprocess.run(
        [sys.executable, "-m", "service.driver.job_driver", "--spec", str(spec),
         "--storage", str(tmp_path / "runs"), "--data-root", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""}, capture_output=True, text=True,
        timeout=120)


@pytest.mark.parametrize("name,text,line,column,fmt", BROKEN, ids=BROKEN_IDS)
def test_the_entrypoint_exits_2_naming_the_place(tmp_path, name, text, line, column, fmt):
    path = _write(tmp_path, name, text)
    proc = _entrypoint(tmp_path, path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _names_the_place(proc.stderr, path, line, column, fmt)
    assert "Started a local Ray" not in proc.stderr and not (tmp_path / "runs").exists()


def test_the_entrypoint_reads_toml_up_to_the_input_checks(tmp_path):
    """A valid TOML spec whose [data] source does not exist: the refusal names that
    field and the file name written in the TOML, so the TOML was read as TOML."""
    text = VALID_TOML.replace("[data]\n", '[data]\nsource = "missing-corpus.txt"\n')
    proc = _entrypoint(tmp_path, _write(tmp_path, "job.toml", text))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("error: data.source: no file 'missing-corpus.txt' under the data root"
            in proc.stderr), proc.stderr[-3000:]
    assert "Started a local Ray" not in proc.stderr


# -- the service: a TOML spec through the CLI, JSON bodies that do not parse ----------------
@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    service = Service(str(tmp_path_factory.mktemp("spec-files")), DMUON_LOCAL_RAY="0")
    yield service
    service.kill()


def test_a_toml_spec_plans_and_submits_through_the_cli(svc, tmp_path):
    path = _write(tmp_path, "job.toml", VALID_TOML)
    env = {"DMUON_URL": svc.url, "DMUON_API_TOKEN": svc.token}
    planned = _cli("plan", str(path), "--json", **env)
    assert planned.returncode == 0, planned.stderr
    mesh = {"replicate": 2, "shard": 2, "nodes": 1, "tp": 1, "ep": 1, "pp": 1}
    layout = json.loads(planned.stdout)["layout"]
    assert {k: layout[k] for k in mesh} == mesh
    submitted = _cli("submit", str(path), "--dry-run", **env)
    assert submitted.returncode == 0, submitted.stderr
    status, job = svc.request("GET", f"/v1/jobs/{submitted.stdout.strip()}")
    assert status == 200 and job["spec"] == parse_spec(VALID_DATA).model_dump(mode="json")
    assert (job["spec"]["name"], job["spec"]["optimizer"]["adamw_betas"]) == (
        "from-toml", [0.9, 0.99])


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/plan"])
def test_a_json_body_that_does_not_parse_is_a_422_with_line_and_column(svc, path):
    # line 2 is '  "steps": 5,,': its second comma is the 14th character
    body = b'{"spec": {"model": "tiny",\n  "steps": 5,,\n  "seq_len": 32}}'
    if path == "/v1/plan":
        body = b'{"model": "tiny",\n  "steps": 5,,\n  "seq_len": 32}'
    status, answer = svc.request("POST", path, data=body)
    assert status == 422, answer
    assert answer["detail"] == [{"field": "body", "message": "not valid JSON: Expecting "
                                 "property name enclosed in double quotes: line 2, "
                                 "column 14"}]


# -- item 8: the serializer warning, the dashboard's model name ------------------------------
HF = {"hf_arch": "LlamaForCausalLM", "config": {"hidden_size": 64}}
FACTORY = {"factory": "mypkg.models:build", "kwargs": {"width": 8}}
DIMS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}


@pytest.mark.parametrize("model", [HF, FACTORY, DIMS, "tiny"],
                         ids=["hf", "factory", "dims", "preset"])
def test_a_spec_serializes_without_pydantic_warnings(model):
    spec = parse_spec({"model": model})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a serializer warning fails the test
        dumped = spec.model_dump(mode="json")  # what POST /v1/jobs stores
        spec.model_dump_json()
    if isinstance(model, dict):
        assert {k: dumped["model"][k] for k in model} == model
    assert parse_spec(dumped) == spec


def test_the_dashboard_names_every_kind_of_model():
    from playwright._impl._driver import compute_driver_executable

    node = compute_driver_executable()[0]  # the Node.js that Playwright ships
    script = os.path.join(ROOT, "service", "control", "static", "model_name.js")
    models = ["tiny", {**HF, "hf": "models/llama", "weights": None}, HF,
              {"hf": "models/llama", "hf_arch": None, "config": {}}, FACTORY, DIMS]
    code = (f"const {{ modelName }} = require({json.dumps(script)});"
            f"console.log(JSON.stringify({json.dumps(models)}.map(modelName)));")
    out = subprocess.run([node, "-e", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        "tiny", "LlamaForCausalLM (models/llama)", "LlamaForCausalLM",
        "Hugging Face (models/llama)", "factory mypkg.models:build",
        "Llama dim 64, 2 layers, 4 heads (2 kv), ffn 128"]


def test_a_spec_with_two_bad_fields_prints_a_line_per_field(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("model: tiny\noptimizer: {lr: -1, momentum: 7}\nclip_grad_norm: 0\n")
    assert cli_main(["plan", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: invalid job spec:"
    assert [line.split(":")[0] for line in err[1:]] == [
        "  spec.optimizer.lr", "  spec.optimizer.momentum", "  spec.clip_grad_norm"]
    assert err[3].endswith("null turns clipping off")

def test_a_missing_spec_file_is_a_usage_error(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert cli_main(["submit", str(missing)]) == 2
    assert capsys.readouterr().err == (f"error: {missing}: cannot read the spec file: "
                                       "No such file or directory\n")
