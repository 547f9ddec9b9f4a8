"""task=dataset: local parquet / jsonl / arrow / save_to_disk data through HF datasets, the
column mapping, chat messages and system prompts, seeded epochs and resume, held-out and
named eval splits, the errors (at build and at start-up), and the word-problem tool."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from hydra import compose, initialize_config_module  # noqa: E402

from moerl.config.store import register_configs  # noqa: E402
from moerl.config.task import DatasetTaskConfig  # noqa: E402
from moerl.models.tokenizer import build_tiny_tokenizer  # noqa: E402
from moerl.rollout.cursor import DataCursor  # noqa: E402
from moerl.tasks import DatasetTask, Prompt, build_task, check_task_config  # noqa: E402
from moerl.validate import validate_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOK = build_tiny_tokenizer()
UNK = TOK.convert_tokens_to_ids("<unk>")
ROWS = [
    {"q": f"{i}+{i + 1}=", "a": str(2 * i + 1), "level": i % 3, "tag": f"t{i}"} for i in range(12)
]


def take(task: Any, n: int, start: int = 0) -> list[Prompt]:
    return list(itertools.islice(task.prompts(start), n))


def write(path: Path, fmt: str, rows: list[dict[str, Any]] = ROWS) -> Path:
    """`rows` as a `fmt` file or save_to_disk directory at `path`."""
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        pq.write_table(table, path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    elif fmt == "disk":
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    elif fmt == "disk_dict":
        full = datasets.Dataset.from_list(rows)
        parts = {"train": full.select(range(8)), "test": full.select(range(8, 12))}
        datasets.DatasetDict(parts).save_to_disk(str(path))
    return path


def config(path: Path, **options: Any) -> DatasetTaskConfig:
    mapping = dict(prompt_key="q", answer_key="a", cache_dir=str(path.parent / "cache"))
    return DatasetTaskConfig(path=str(path), **{**mapping, **options})


@pytest.fixture
def parquet(tmp_path: Path) -> Path:
    return write(tmp_path / "data.parquet", "parquet")


# ---- formats and the column mapping -----------------------------------------------------


@pytest.mark.parametrize(
    "fmt, name",
    [
        ("parquet", "d.parquet"),
        ("jsonl", "d.jsonl"),
        ("arrow", "d.arrow"),
        ("disk", "saved"),
        ("disk_dict", "saved_dict"),
    ],
)
def test_each_format_loads_with_the_field_mapping(tmp_path: Path, fmt: str, name: str) -> None:
    path = write(tmp_path / name, fmt)
    cfg = config(path, metadata_keys=["level", "tag"], shuffle=False)
    task = build_task(cfg, TOK)
    n = 8 if fmt == "disk_dict" else 12  # the DatasetDict's train split
    assert isinstance(task, DatasetTask) and task.num_items == n
    prompts = take(task, n + 1)
    for i, p in enumerate(prompts[:n]):
        assert p.prompt_id == i and p.text == f"{i}+{i + 1}=" and p.answer == str(2 * i + 1)
        assert p.meta == {"item": i, "level": i % 3, "tag": f"t{i}"}
        assert TOK.decode(p.input_ids, skip_special_tokens=True) == p.text
        assert p.input_ids[0] == TOK.bos_token_id
    assert prompts[n].text == prompts[0].text  # the next epoch
    if fmt == "disk_dict":
        test = build_task(config(path, split="test"), TOK)
        assert sorted(p.answer for p in take(test, 4)) == sorted(r["a"] for r in ROWS[8:])


def test_a_directory_of_split_files_and_a_glob(tmp_path: Path) -> None:
    folder = tmp_path / "splits"
    folder.mkdir()
    write(folder / "train.parquet", "parquet", ROWS[:9])
    write(folder / "test.parquet", "parquet", ROWS[9:])
    cfg = config(folder, eval_split="test")
    assert build_task(cfg, TOK).num_items == 9
    assert build_task(cfg.for_eval(), TOK).num_items == 3
    # the files of a glob are one split
    shards = config(folder / "*.parquet", shuffle=False, cache_dir=str(tmp_path / "cache"))
    assert build_task(shards, TOK).num_items == 12
    with pytest.raises(ValueError, match="split='validation'.*has the splits train, test"):
        build_task(config(folder, split="validation"), TOK)


# ---- chat messages and the system prompt ------------------------------------------------


def chat_rows() -> list[dict[str, Any]]:
    plain = [{"role": "user", "content": "2+2="}]
    own = [{"role": "system", "content": "be short."}, {"role": "user", "content": "3+3="}]
    return [
        {"messages": plain, "q": "2+2=", "a": "4"},
        {"messages": own, "q": "3+3=", "a": "6"},
    ]


def rendered(task: Any) -> list[str]:
    by_item = {p.meta["item"]: p for p in take(task, 2)}
    return [TOK.decode(by_item[i].input_ids) for i in range(2)]


def test_messages_through_the_chat_template(tmp_path: Path) -> None:
    path = write(tmp_path / "chat.jsonl", "jsonl", chat_rows())
    bare = build_task(config(path, messages_key="messages", chat_template=True), TOK)
    assert rendered(bare) == [
        "user: 2+2= assistant: ",
        "system: be short. user: 3+3= assistant: ",
    ]
    system = config(path, messages_key="messages", chat_template=True, system_prompt="say it.")
    assert rendered(build_task(system, TOK)) == [
        "system: say it. user: 2+2= assistant: ",
        "system: be short. user: 3+3= assistant: ",  # the data's own system message wins
    ]
    assert take(build_task(system, TOK), 1)[0].text.endswith("assistant: ")
    raw = config(path, chat_template=True, system_prompt="say it.")  # text prompts, templated
    assert rendered(build_task(raw, TOK))[0] == "system: say it. user: 2+2= assistant: "
    assert rendered(build_task(config(path), TOK)) == ["<bos>2+2=", "<bos>3+3="]


def test_chat_template_errors(tmp_path: Path) -> None:
    path = write(tmp_path / "chat.jsonl", "jsonl", chat_rows())
    no_template = build_tiny_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="tokenizer .* has no chat template"):
        build_task(config(path, messages_key="messages", chat_template=True), no_template)
    with pytest.raises(ValueError, match="task.messages_key='messages'.*chat_template=true"):
        check_task_config(config(path, messages_key="messages"))
    with pytest.raises(ValueError, match="task.system_prompt is set.*chat_template=true"):
        check_task_config(config(path, system_prompt="hi"))
    with pytest.raises(ValueError, match="column 'messages' is list, not text"):
        take(build_task(config(path, prompt_key="messages"), TOK), 2)


# ---- order: seeded epochs and resume ----------------------------------------------------


def items(task: Any, n: int, start: int = 0) -> list[int]:
    return [p.meta["item"] for p in take(task, n, start)]


def test_shuffle_is_seeded_per_epoch(parquet: Path) -> None:
    order = items(build_task(config(parquet, seed=3), TOK), 36)
    assert order == items(build_task(config(parquet, seed=3), TOK), 36)
    epochs = [order[i : i + 12] for i in (0, 12, 24)]
    assert all(sorted(e) == list(range(12)) for e in epochs)  # each epoch visits every row
    assert epochs[0] != epochs[1] != epochs[2]
    assert items(build_task(config(parquet, seed=4), TOK), 12) != epochs[0]
    assert items(build_task(config(parquet, shuffle=False), TOK), 13) == [*range(12), 0]


def test_resume_at_the_cursor_gives_the_same_next_prompts(parquet: Path) -> None:
    cfg = config(parquet, seed=7, metadata_keys=["tag"])
    stream = take(build_task(cfg, TOK), 30)
    for n in (0, 5, 12, 17):
        resumed = take(build_task(cfg, TOK), 30 - n, start=n)  # a fresh task, as a restart
        assert [(p.prompt_id, p.text, p.meta) for p in resumed] == [
            (p.prompt_id, p.text, p.meta) for p in stream[n:]
        ]
    cursor = DataCursor(build_task(cfg, TOK))
    for _ in range(5):
        item = cursor.next()
        assert item is not None
        cursor.settle(item.pos)
    restarted = DataCursor(build_task(cfg, TOK))
    restarted.load_state_dict(cursor.state_dict())
    nxt = restarted.next()
    assert nxt is not None and nxt.prompt is not None
    assert (nxt.pos, nxt.prompt.text) == (5, stream[5].text)


# ---- held-out and named eval splits -----------------------------------------------------


def test_eval_fraction_holds_out_a_fixed_disjoint_part(parquet: Path) -> None:
    cfg = config(parquet, eval_fraction=0.25, seed=1)
    train = {p.text for p in take(build_task(cfg, TOK), 9)}
    held = {p.text for p in take(build_task(cfg.for_eval(), TOK), 3)}
    assert len(train) == 9 and len(held) == 3 and not train & held
    assert train | held == {r["q"] for r in ROWS}
    other_seed = config(parquet, eval_fraction=0.25, seed=2)  # same held-out rows
    assert {p.text for p in take(build_task(other_seed.for_eval(), TOK), 3)} == held
    other_split = config(parquet, eval_fraction=0.25, split_seed=5)
    assert {p.text for p in take(build_task(other_split.for_eval(), TOK), 3)} != held
    assert build_task(cfg.for_eval(), TOK).shuffle is False
    with pytest.raises(ValueError, match="no evaluation data"):
        config(parquet).for_eval()
    with pytest.raises(ValueError, match=r"eval_fraction=1.0 must be in \[0, 1\)"):
        check_task_config(config(parquet, eval_fraction=1.0))


# ---- errors name the problem, at build and at start-up ----------------------------------


def test_bad_paths_and_keys_name_the_problem(parquet: Path, tmp_path: Path) -> None:
    cases = [
        (config(tmp_path / "nope.parquet"), "nope.parquet' does not exist; give a local"),
        (DatasetTaskConfig(), "task.path is empty"),
        (
            DatasetTaskConfig(path="hf://datasets/x/y"),
            "is a URL; task=dataset reads local files only",
        ),
        (config(parquet, prompt_key="question"), r"task.prompt_key='question'.*columns: q, a"),
        (config(parquet, answer_key="label"), "no column 'label'"),
        (config(parquet, metadata_keys=["src"]), r"task.metadata_keys='src'"),
        (config(parquet, split="test"), "split='test'.*has the splits train"),
        (config(parquet, eval_split="dev"), "eval_split='dev'"),
        (config(parquet, format="csv"), "format='csv' is not one of parquet, json, arrow"),
        (config(tmp_path / "x.txt"), None),
    ]
    (tmp_path / "x.txt").write_text("hello\n")
    for cfg, message in cases:
        message = message or r"cannot tell the format from the suffix '.txt'"
        with pytest.raises(ValueError, match=message):
            check_task_config(cfg)  # start-up, without a tokenizer
        with pytest.raises(ValueError, match=message):
            build_task(cfg, TOK)


def test_launcher_validation_checks_the_data(parquet: Path, tmp_path: Path) -> None:
    register_configs()

    def validate(*overrides: str) -> Any:
        with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=["task=dataset", *overrides])
        return validate_config(cfg, world_size=1)

    good = validate(f"task.path={parquet}", "task.prompt_key=q", "task.answer_key=a")
    assert isinstance(good.task, DatasetTaskConfig) and good.task.prompt_key == "q"
    with pytest.raises(ValueError, match="missing.parquet' does not exist"):
        validate(f"task.path={tmp_path / 'missing.parquet'}")
    with pytest.raises(ValueError, match="task.prompt_key='prompt'.*columns: q, a, level, tag"):
        validate(f"task.path={parquet}", "task.answer_key=a")


def test_without_datasets_the_error_names_the_extra(parquet: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'moerl\[data\]'"):
        build_task(config(parquet), TOK)


# ---- the word-problem tool --------------------------------------------------------------


def load_tool() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_word_problems", ROOT / "tools/make_word_problems.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_word_problems_load_as_a_dataset_task(tmp_path: Path) -> None:
    tool = load_tool()
    tool.main(["--out", str(tmp_path / "wp"), "--num-train", "200", "--num-test", "40"])
    again = tool.write_word_problems(tmp_path / "again", 200, 40, seed=0)
    for split in ("train", "test"):  # a function of the seed
        a = pq.read_table(tmp_path / "wp" / f"{split}.parquet")
        assert a.equals(pq.read_table(again[split]))
    cfg = config(tmp_path / "wp", prompt_key="prompt", answer_key="answer", eval_split="test")
    cfg.metadata_keys = ["difficulty", "kind"]
    train, test = build_task(cfg, TOK), build_task(cfg.for_eval(), TOK)
    assert (train.num_items, test.num_items) == (200, 40)
    train_prompts, test_prompts = take(train, 200), take(test, 40)
    assert not {p.text for p in train_prompts} & {p.text for p in test_prompts}
    for p in train_prompts + test_prompts:
        assert UNK not in p.input_ids, p.text
        assert len(p.input_ids) <= tool.MAX_PROMPT_CHARS + 1  # + BOS: fits the tiny models
        assert UNK not in TOK(p.answer)["input_ids"]
        assert p.meta["difficulty"] in (1, 2, 3) and p.answer.lstrip("-").isdigit()
    assert {p.meta["difficulty"] for p in train_prompts} == {1, 2, 3}
    chat = config(tmp_path / "wp", messages_key="messages", answer_key="answer")
    chat.chat_template, chat.system_prompt = True, "answer with a number."
    for p in take(build_task(chat, TOK), 50):
        assert UNK not in p.input_ids and p.text.startswith("system: answer with a number.")


def test_word_problem_answers_are_right() -> None:
    tool = load_tool()
    rng = np.random.default_rng(0)
    for row in tool.make_problems(300, rng, set()):
        numbers = [
            int(t) for t in row["prompt"].replace(",", " ").replace(".", " ").split() if t.isdigit()
        ]
        kind, answer = row["kind"], int(row["answer"])
        expected = {
            "buy": lambda a, b: a + b,
            "give": lambda a, b: a - b,
            "groups": lambda each, n: each * n,
            "share": lambda total, kids: total // kids,
            "buy_then_give": lambda a, b, c: a + b - c,
            "groups_plus": lambda n, each, loose: n * each + loose,
        }[kind](*numbers)
        assert answer == expected >= 0, row["prompt"]
