"""The Dockerfiles, read as text (no image can be built here): multi-stage, every RUN is
deploy/install.sh or a trivial user/venv step, a non-root USER, `kvstore` as the entrypoint,
OCI labels; and each install.sh invocation is one the script accepts (--dry-run)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest

from tests.deploy.tools import DEPLOY, ROOT

DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile*"))
TRIVIAL_RUN = re.compile(
    r"^(python3? -m venv( --system-site-packages)? /opt/kvstore|"
    r"groupadd .* && useradd .*)$"
)
OCI_LABELS = {"title", "description", "version", "licenses", "source"}


def instructions(path):
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            yield word.upper(), rest.strip()


@pytest.fixture(params=DOCKERFILES, ids=lambda p: p.name)
def dockerfile(request):
    return list(instructions(request.param))


def test_there_is_a_cpu_and_a_cuda_image():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cuda"]


def test_multi_stage_with_pinned_bases(dockerfile):
    stages = [rest for word, rest in dockerfile if word == "FROM"]
    assert len(stages) >= 2 and any(" AS " in stage for stage in stages)
    for word, rest in dockerfile:
        if word == "ARG" and "IMAGE=" in rest:
            image = rest.split("=", 1)[1]
            assert ":" in image and not image.endswith(":latest"), image


def test_every_run_is_the_install_script_or_trivial(dockerfile):
    runs = [rest for word, rest in dockerfile if word == "RUN"]
    installs = [run for run in runs if run.startswith("deploy/install.sh")]
    assert len(installs) == 1
    for run in runs:
        assert run in installs or TRIVIAL_RUN.match(run), f"RUN does what CI never runs: {run}"


def test_the_install_invocation_is_one_the_script_accepts(dockerfile):
    install = next(rest for word, rest in dockerfile if word == "RUN" and "install.sh" in rest)
    args = shlex.split(install)[1:]
    args[-1] = str(ROOT)  # the COPY of the project: /src in the image
    result = subprocess.run(
        [str(DEPLOY / "install.sh"), "--dry-run", *args], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "pip install" in result.stdout and "-e " not in result.stdout


def test_the_image_runs_kvstore_as_a_non_root_user(dockerfile):
    final = dockerfile[max(i for i, (word, _) in enumerate(dockerfile) if word == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].split(":")[0].isdigit()  # numeric: runAsNonRoot can verify it
    assert [json.loads(rest) for word, rest in final if word == "ENTRYPOINT"] == [["kvstore"]]
    labels = " ".join(rest for word, rest in final if word == "LABEL")
    assert {m for m in re.findall(r"org\.opencontainers\.image\.(\w+)=", labels)} >= OCI_LABELS


def test_ci_installs_with_the_same_script():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "deploy/install.sh --editable" in ci and "deploy/test-tools.sh" in ci


def test_the_build_stage_can_compile_the_extension_and_copies_its_sources(dockerfile):
    """kvstore._copyhash is C: the stage that runs install.sh has a compiler (not a slim
    image) and the files setuptools builds it from (setup.py; the sources are in kvstore/)."""
    first, second = [i for i, (word, _) in enumerate(dockerfile) if word == "FROM"][:2]
    build = dockerfile[first:second]
    base = build[0][1].split()[0]
    args = [rest for word, rest in dockerfile if word == "ARG" and "=" in rest]
    defaults = dict(arg.split("=", 1) for arg in args)
    image = defaults.get(base.strip("${}"), base)
    assert "slim" not in image and "alpine" not in image, image
    copied = " ".join(rest for word, rest in build if word == "COPY")
    assert "setup.py" in copied and "kvstore" in copied
