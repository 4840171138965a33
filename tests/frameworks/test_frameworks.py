"""The real libraries on CPU under `memtrack run`, with no memtrack code in
the jobs: the automatic hooks give Hugging Face and Lightning trainers
step spans, evaluation, checkpoint and fit stages and batch-size labels;
MLflow gets the memory figures and the artifact; a framework that is not
the expected one leaves the job running and is said once; an uncaught
MemoryError is reported before the job dies.

Run with the Python that has torch, transformers, lightning and mlflow
(scripts/test makes that venv)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import JOBS, events, job_env, printed, run_memtrack, stages, step_spans

STEPS = 20
BATCH = 4
ACCUM = 2


def _check_training(doc, proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    spans = step_spans(doc)
    assert [i for i, _ in spans] == list(range(1, STEPS + 1))
    for _, labels in spans:
        assert labels == {"batch_size": str(BATCH), "grad_accum": str(ACCUM),
                          "rank": "0", "world_size": "1"}
    ends = [e.get("iteration") for e in events(doc)
            if e["component"] == "train" and e["operation"] == "after_step"]
    assert ends == list(range(1, STEPS + 1))
    fit = stages(doc, "fit")
    assert len(fit) == 1 and fit[0]["status"] == "SUCCESS"
    # Evaluation and a checkpoint every 10 steps, each at its global step.
    for name in ("evaluate", "save"):
        found = stages(doc, name)
        assert [s["labels"]["global_step"] for s in found] == ["10", "20"], (name, found)
        assert all(s["status"] == "SUCCESS" for s in found)
    for trouble in ("not the one memtrack knows", "cannot add memtrack", "hooks not installed", "cannot hook"):
        assert trouble not in proc.stderr, proc.stderr[-4000:]


def test_hugging_face_trainer_gets_phases_without_code(tmp_path):
    doc, proc = run_memtrack(tmp_path, [os.path.join(JOBS, "hf_job.py"), str(tmp_path / "ckpt"),
                                        str(STEPS), str(BATCH), str(ACCUM)])
    _check_training(doc, proc)
    assert [s["labels"]["global_step"] for s in stages(doc, "predict")] == [str(STEPS)]
    assert "job finished %d" % STEPS in proc.stdout


def test_lightning_trainer_gets_phases_without_code(tmp_path):
    doc, proc = run_memtrack(tmp_path, [os.path.join(JOBS, "lightning_job.py"), str(tmp_path / "ckpt"),
                                        str(STEPS), str(BATCH), str(ACCUM)])
    _check_training(doc, proc)
    assert len(stages(doc, "sanity_check")) == 1
    assert "job finished %d" % STEPS in proc.stdout


def test_switched_off_the_job_runs_bare(tmp_path):
    env = job_env(MEMTRACK_AUTO_HOOKS="0")
    doc, proc = run_memtrack(tmp_path, [os.path.join(JOBS, "lightning_job.py"), str(tmp_path / "ckpt"),
                                        "4", str(BATCH), "1"], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert step_spans(doc) == [] and doc["stages"] == []
    (tmp_path / "flag").mkdir()
    doc, proc = run_memtrack(tmp_path / "flag", [os.path.join(JOBS, "lightning_job.py"),
                                                 str(tmp_path / "ckpt2"), "4", str(BATCH), "1"],
                             flags=["--no-auto-hooks"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert step_spans(doc) == [] and doc["stages"] == []


def test_a_trainer_memtrack_does_not_know_leaves_the_job_alone(tmp_path):
    """A fake `transformers` whose Trainer takes no callbacks: the job runs
    to its end, and memtrack says why once (two trainers, one line)."""
    fake = tmp_path / "fake"
    (fake / "transformers").mkdir(parents=True)
    (fake / "transformers" / "__init__.py").write_text("__version__ = '0.0.1'\nfrom .trainer import Trainer\n")
    (fake / "transformers" / "trainer.py").write_text(
        "class Trainer:\n"
        "    def __init__(self, model):\n"
        "        self.model = model\n"
        "    def train(self):\n"
        "        return 'trained ' + self.model\n")
    job = tmp_path / "job.py"
    job.write_text("from transformers import Trainer\n"
                   "print(Trainer('a').train(), Trainer('b').train())\n")
    (tmp_path / "usersite").mkdir()
    # The user's own sitecustomize still runs (memtrack's chains to it).
    (tmp_path / "usersite" / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITE_RAN = True\n")
    job.write_text(job.read_text() + "import builtins\nprint('user site', getattr(builtins, 'USER_SITE_RAN', False))\n")
    env = job_env(PYTHONPATH="%s:%s" % (fake, tmp_path / "usersite"))
    doc, proc = run_memtrack(tmp_path, [str(job)], env=env)
    assert proc.returncode == 0, proc.stderr
    assert "trained a trained b" in proc.stdout
    assert "user site True" in proc.stdout
    said = [line for line in proc.stderr.splitlines() if "not the one memtrack knows" in line]
    assert len(said) == 1, proc.stderr
    assert "transformers 0.0.1" in said[0] and "add_callback" in said[0]


def test_an_uncaught_memory_error_is_reported_before_the_job_dies(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("raise MemoryError('cannot allocate 1 TiB')\n")
    doc, proc = run_memtrack(tmp_path, [str(job)])
    assert proc.returncode == 1
    assert "MemoryError: cannot allocate 1 TiB" in proc.stderr  # Python's own report still runs
    oom = [e for e in events(doc) if (e["component"], e["operation"]) == ("host", "out_of_memory")]
    assert len(oom) == 1, events(doc)
    assert "cannot allocate 1 TiB" in oom[0]["labels"]["error"]


# -- MLflow -------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    base = "http://127.0.0.1:%d" % port
    log = open(tmp_path / "mlflow.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", "sqlite:///%s" % (tmp_path / "mlflow.db"),
         "--artifacts-destination", str(tmp_path / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, env=job_env(), cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("mlflow server did not start:\n" + (tmp_path / "mlflow.log").read_text()[-4000:])
                time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_mlflow_gets_the_memory_figures_and_the_artifact(tmp_path, mlflow_server):
    env = job_env(MLFLOW_TRACKING_URI=mlflow_server)
    doc, proc = run_memtrack(tmp_path, [os.path.join(JOBS, "hf_job.py"), str(tmp_path / "ckpt"),
                                        "12", str(BATCH), "1"], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    req = urllib.request.Request(mlflow_server + "/api/2.0/mlflow/runs/search",
                                 data=json.dumps({"experiment_ids": ["0"]}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        runs = json.load(r)["runs"]
    assert len(runs) == 1, runs
    run = runs[0]
    assert run["info"]["status"] == "FINISHED"
    run_id = run["info"]["run_id"]
    keys = {m["key"] for m in run["data"]["metrics"]}
    assert {"memtrack/host_mb", "memtrack/peak_host_mb"} <= keys
    history = _get(mlflow_server + "/api/2.0/mlflow/metrics/get-history?run_id=%s"
                   "&metric_key=memtrack/host_mb&max_results=100000" % run_id)["metrics"]
    samples = doc["detailed_log"]
    # Every sample, at the last iteration seen (MLflow keeps one of equal values).
    expected, step = set(), 0
    for e in samples:
        step = e.get("iteration", step)
        expected.add((int(e["timestamp"] * 1000), step, e["cpu_ram_used_mb"]))
    assert {(m["timestamp"], m["step"], m["value"]) for m in history} == expected
    # The job's iteration axis: every step span's iteration is a step there.
    assert set(range(1, 13)) <= {m["step"] for m in history}
    peak = [m for m in run["data"]["metrics"] if m["key"] == "memtrack/peak_host_mb"][0]["value"]
    assert peak >= max(e["cpu_ram_used_mb"] for e in samples) > 0
    files = _get(mlflow_server + "/api/2.0/mlflow/artifacts/list?run_id=%s" % run_id).get("files", [])
    assert sorted(f["path"] for f in files) == ["memory_report.html", "memory_usage.json"]
    with urllib.request.urlopen(mlflow_server + "/get-artifact?path=memory_usage.json&run_uuid=%s" % run_id,
                                timeout=10) as r:
        assert json.load(r)["run"]["id"] == doc["run"]["id"]
    # The report page beside it, which MLflow's UI shows as HTML.
    with urllib.request.urlopen(mlflow_server + "/get-artifact?path=memory_report.html&run_uuid=%s" % run_id,
                                timeout=10) as r:
        assert b'id="memtrack-data"' in r.read()


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def _all_runs(server):
    experiments = _post(server + "/api/2.0/mlflow/experiments/search",
                        {"max_results": 1000})["experiments"]
    ids = [e["experiment_id"] for e in experiments]
    return _post(server + "/api/2.0/mlflow/runs/search",
                 {"experiment_ids": ids, "max_results": 1000}).get("runs", [])


def test_a_script_inside_start_run_gets_the_memory_in_its_own_run_and_experiment(tmp_path, mlflow_server):
    """What once failed: with no memtrack code, memtrack made a second run in
    experiment 0 beside the script's. The automatic hooks announce the run
    as `mlflow.start_run` returns it (a nested run is not announced)."""
    job = tmp_path / "job.py"
    job.write_text(
        "import time\n"
        "import mlflow\n"
        "with mlflow.start_run(run_name='own run') as run:\n"
        "    keep = []\n"
        "    for i in range(5):\n"
        "        keep.append(bytearray(4 << 20))\n"
        "        mlflow.log_metric('loss', 1.0 / (i + 1), step=i)\n"
        "        time.sleep(0.2)\n"
        "    with mlflow.start_run(run_name='child', nested=True):\n"
        "        mlflow.log_metric('child_loss', 1.0)\n"
        "    print('RUN', run.info.run_id, run.info.experiment_id, flush=True)\n")
    env = job_env(MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME="memtrack-own")
    doc, proc = run_memtrack(tmp_path, [str(job)], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RUN ")]
    assert line, proc.stdout + proc.stderr[-4000:]
    run_id, experiment_id = line[0].split()[1:]
    experiment = _get(mlflow_server + "/api/2.0/mlflow/experiments/get-by-name"
                      "?experiment_name=memtrack-own")["experiment"]
    assert experiment["experiment_id"] == experiment_id
    runs = {r["info"]["run_id"]: r for r in _all_runs(mlflow_server)}
    assert len(runs) == 2, "the script's run and its child, no run of memtrack's: %s" % runs
    run = runs[run_id]
    assert run["info"]["run_name"] == "own run"
    assert run["info"]["status"] == "FINISHED"
    keys = {m["key"] for m in run["data"]["metrics"]}
    assert {"loss", "memtrack/host_mb", "memtrack/peak_host_mb"} <= keys, keys
    child = [r for r in runs.values() if r["info"]["run_id"] != run_id][0]
    assert not any(m["key"].startswith("memtrack/") for m in child["data"].get("metrics", []))
    files = _get(mlflow_server + "/api/2.0/mlflow/artifacts/list?run_id=%s" % run_id).get("files", [])
    assert sorted(f["path"] for f in files) == ["memory_report.html", "memory_usage.json"]
    assert "logged into run %s" % run_id in proc.stderr, proc.stderr[-4000:]


def test_a_run_memtrack_creates_goes_to_the_experiment_mlflow_experiment_name_names(tmp_path, mlflow_server):
    """What once failed: MLFLOW_EXPERIMENT_NAME was ignored and memtrack's
    run went to experiment 0. Like MLflow's client, memtrack creates the
    experiment when the server has none of that name."""
    job = tmp_path / "job.py"
    job.write_text("keep = bytearray(4 << 20)\nprint('done', flush=True)\n")
    env = job_env(MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME="memtrack made")
    doc, proc = run_memtrack(tmp_path, [str(job)], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    experiment = _get(mlflow_server + "/api/2.0/mlflow/experiments/get-by-name"
                      "?experiment_name=memtrack%20made")["experiment"]
    runs = _all_runs(mlflow_server)
    assert [r["info"]["experiment_id"] for r in runs] == [experiment["experiment_id"]], runs
    run = runs[0]
    assert run["info"]["status"] == "FINISHED"
    assert {"memtrack/host_mb", "memtrack/peak_host_mb"} <= {m["key"] for m in run["data"]["metrics"]}


def test_the_announcing_hooks_import_nothing_and_an_unknown_sdk_leaves_the_job_alone(tmp_path):
    """The hooks import neither ClearML nor MLflow ahead of the job; a
    `clearml` whose Task.init is not the SDK's classmethod, and an `mlflow`
    whose start_run fails, leave the job running, said once."""
    fake = tmp_path / "fake"
    (fake / "clearml").mkdir(parents=True)
    (fake / "clearml" / "__init__.py").write_text("__version__ = '0.0.1'\nfrom .task import Task\n")
    (fake / "clearml" / "task.py").write_text(
        "class Task:\n"
        "    id = 'abc'\n"
        "    @staticmethod\n"
        "    def init(**kwargs):\n"
        "        return Task()\n")
    (fake / "mlflow" / "tracking").mkdir(parents=True)
    (fake / "mlflow" / "__init__.py").write_text("from .tracking.fluent import start_run, active_run\n")
    (fake / "mlflow" / "tracking" / "__init__.py").write_text("")
    (fake / "mlflow" / "tracking" / "fluent.py").write_text(
        "def active_run():\n"
        "    return None\n"
        "def start_run(**kwargs):\n"
        "    return object()  # no .info: announcing it fails\n")
    job = tmp_path / "job.py"
    job.write_text(
        "import sys\n"
        "print('before', 'clearml' in sys.modules, 'mlflow' in sys.modules, 'memtrack.hooks' in sys.modules)\n"
        "from clearml import Task\n"
        "import mlflow\n"
        "print('task', Task.init(project_name='p').id, mlflow.start_run() is not None, mlflow.start_run() is not None)\n")
    env = job_env(PYTHONPATH=str(fake))
    doc, proc = run_memtrack(tmp_path, [str(job)], env=env)
    assert proc.returncode == 0, proc.stderr
    assert "before False False True" in proc.stdout, proc.stdout + proc.stderr
    assert "task abc True True" in proc.stdout, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("memtrack: ") and "clearml" in line]
    assert len(said) == 1 and "clearml 0.0.1" in said[0] and "clearml_announce" in said[0], proc.stderr
    said = [line for line in proc.stderr.splitlines() if "MLflow run" in line]
    assert len(said) == 1 and "the job runs on" in said[0], proc.stderr


def test_an_autolog_run_gets_the_memory_without_memtrack_code(tmp_path, mlflow_server):
    """autolog starts its own run around `fit` (through mlflow.start_run):
    memtrack's figures go there, not into a second run."""
    job = tmp_path / "job.py"
    job.write_text(
        "import mlflow, numpy\n"
        "from sklearn.linear_model import LinearRegression\n"
        "mlflow.sklearn.autolog(log_models=False, log_datasets=False)\n"
        "x = numpy.random.rand(64, 3)\n"
        "LinearRegression().fit(x, x.sum(axis=1))\n"
        "print('RUN', mlflow.last_active_run().info.run_id, flush=True)\n")
    env = job_env(MLFLOW_TRACKING_URI=mlflow_server)
    doc, proc = run_memtrack(tmp_path, [str(job)], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RUN ")]
    assert line, proc.stdout + proc.stderr[-4000:]
    runs = _all_runs(mlflow_server)
    assert [r["info"]["run_id"] for r in runs] == [line[0].split()[1]], runs
    keys = {m["key"] for m in runs[0]["data"]["metrics"]}
    assert {"training_score", "memtrack/host_mb", "memtrack/peak_host_mb"} <= keys, keys


def test_the_lightning_callback_costs_the_loop_only_the_hooks_it_uses(tmp_path):
    """Lightning calls every callback's hook at every step, each inside a
    profiler context, unless the hook is not callable: memtrack's callback
    is dispatched for no per-batch hook at all, the step being marked from
    the module's own batch hooks, which Lightning calls anyway. Lightning's
    simple profiler records each dispatch it makes. The module's own hook
    still runs at every batch, the module pickles during the fit, and its
    class is as it was once the fit is over."""
    job = tmp_path / "job.py"
    job.write_text(
        "import json, pickle, sys, torch\n"
        "import lightning.pytorch as pl\n"
        "class Tiny(pl.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Linear(4, 1)\n"
        "        self.seen = []\n"
        "    def on_train_batch_start(self, batch, idx):\n"
        "        self.seen.append(idx)\n"
        "        if idx == 2:\n"
        "            pickle.loads(pickle.dumps(self))\n"
        "    def training_step(self, batch, idx):\n"
        "        return self.net(batch[0]).pow(2).mean()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.01)\n"
        "own = Tiny.__dict__['on_train_batch_start']\n"
        "data = torch.utils.data.TensorDataset(torch.randn(20, 4))\n"
        "trainer = pl.Trainer(max_steps=5, accelerator='cpu', logger=False, profiler='simple',\n"
        "                     enable_progress_bar=False, enable_model_summary=False,\n"
        "                     enable_checkpointing=False, default_root_dir=sys.argv[1])\n"
        "model = Tiny()\n"
        "trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))\n"
        "names = [n for n in trainer.profiler.recorded_durations if 'Memtrack' in n]\n"
        "print('DISPATCHED ' + json.dumps(names))\n"
        "print('SEEN ' + json.dumps(model.seen))\n"
        "print('RESTORED ' + json.dumps([Tiny.__dict__['on_train_batch_start'] is own,\n"
        "                                'on_train_batch_end' in Tiny.__dict__]))\n")
    doc, proc = run_memtrack(tmp_path, [str(job), str(tmp_path / "root")])
    assert proc.returncode == 0, proc.stderr[-4000:]

    hooks = {name.rsplit(".", 1)[1] for name in printed(proc, "DISPATCHED")}
    assert "on_train_start" in hooks or "on_fit_start" in hooks, hooks
    assert not hooks & {"on_train_batch_start", "on_train_batch_end", "on_before_backward",
                        "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad"}, hooks
    assert printed(proc, "SEEN") == [0, 1, 2, 3, 4]
    assert printed(proc, "RESTORED") == [True, False]
    assert [i for i, _ in step_spans(doc)] == [1, 2, 3, 4, 5]


def test_the_hugging_face_steps_cost_the_loop_no_callback_dispatch(tmp_path):
    """transformers calls every callback in the handler's list at each of a
    step's four events, with eight keyword arguments, whether it does
    anything then or not: under the automatic hooks memtrack's callback is
    in no list, the step being marked from the handler's own step events.
    The job's own callbacks still see every event, once."""
    job = tmp_path / "job.py"
    job.write_text(
        "import collections, json, sys, torch\n"
        "from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,\n"
        "                          TrainingArguments)\n"
        "class Counting(TrainerCallback):\n"
        "    def __init__(self):\n"
        "        self.seen = collections.Counter()\n"
        "    def on_step_begin(self, args, state, control, **kw):\n"
        "        self.seen['on_step_begin'] += 1\n"
        "    def on_optimizer_step(self, args, state, control, **kw):\n"
        "        self.seen['on_optimizer_step'] += 1\n"
        "    def on_step_end(self, args, state, control, **kw):\n"
        "        self.seen['on_step_end'] += 1\n"
        "    def on_train_end(self, args, state, control, **kw):\n"
        "        self.seen['on_train_end'] += 1\n"
        "class Tokens(torch.utils.data.Dataset):\n"
        "    def __init__(self, n):\n"
        "        self.ids = torch.randint(0, 97, (n, 16))\n"
        "    def __len__(self):\n"
        "        return len(self.ids)\n"
        "    def __getitem__(self, i):\n"
        "        return {'input_ids': self.ids[i], 'labels': self.ids[i]}\n"
        "model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=97, n_positions=16))\n"
        "args = TrainingArguments(output_dir=sys.argv[1], max_steps=5, per_device_train_batch_size=4,\n"
        "                         save_strategy='no', eval_strategy='no', logging_strategy='no',\n"
        "                         report_to=[], use_cpu=True, disable_tqdm=True)\n"
        "counting = Counting()\n"
        "trainer = Trainer(model=model, args=args, train_dataset=Tokens(20), callbacks=[counting])\n"
        "trainer.train()\n"
        "print('LISTED ' + json.dumps([type(c).__name__ for c in trainer.callback_handler.callbacks]))\n"
        "print('SEEN ' + json.dumps(counting.seen))\n")
    doc, proc = run_memtrack(tmp_path, [str(job), str(tmp_path / "out_dir")])
    assert proc.returncode == 0, proc.stderr[-4000:]

    listed = printed(proc, "LISTED")
    assert "Counting" in listed and not [name for name in listed if "Memtrack" in name], listed
    assert printed(proc, "SEEN") == {"on_step_begin": 5, "on_optimizer_step": 5, "on_step_end": 5,
                               "on_train_end": 1}
    assert [i for i, _ in step_spans(doc)] == [1, 2, 3, 4, 5]
    assert len(stages(doc, "fit")) == 1
