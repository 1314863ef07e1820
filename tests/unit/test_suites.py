import hashlib
import json
import os
from pathlib import Path

import pytest

from detaudit import paths
from detaudit.errors import DetauditError
from detaudit.inputs.grading import is_correct
from detaudit.inputs.suites import Prompt, list_suites, load_suite, prompt_hash, prompt_token_ids

SUITES_DIR = paths.builtin_suites_dir()


def _mirror() -> Path:
    env = os.environ.get("DETAUDIT_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared/data/suites"


MIRROR = _mirror()
needs_mirror = pytest.mark.skipif(
    not (MIRROR / "aime24.jsonl").is_file() or not (MIRROR / "amc23.jsonl").is_file(),
    reason=f"suite mirror not found at {MIRROR} "
    "(set DETAUDIT_DATA_DIR to a directory holding aime24.jsonl, amc23.jsonl)",
)


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(DetauditError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, f"error message must be one line: {message!r}"
    return message


# --------------------------------------------------------------------------------------------
# built-in suites


def test_list_suites():
    listed = {s["name"]: s for s in list_suites()}
    assert set(listed) == {"aime24", "amc23", "quote", "smoke"}
    assert listed["smoke"]["source"] == "inline" and listed["smoke"]["needs_data_dir"] is False
    assert listed["aime24"]["dataset_path"] == "HuggingFaceH4/aime_2024"
    assert listed["amc23"]["dataset_path"] == "math-ai/amc23"
    assert listed["aime24"]["needs_data_dir"] and listed["aime24"]["local_file"] == "aime24.jsonl"
    # quote 2.0: its texts were lengthened so answers copy for a bench's 128 tokens
    assert all(s["description"] and s["version"] == ("2.0" if n == "quote" else "1.0") for n, s in listed.items())


def test_smoke_suite_is_inline():
    suite = load_suite("smoke")
    assert suite.name == "smoke" and suite.source == "inline"
    assert suite.path == SUITES_DIR / "smoke.yaml"
    # a checkout reads the repository's suites/ (a wheel ships them inside the package: test_wheel.py)
    assert SUITES_DIR == Path(__file__).resolve().parents[2] / "suites"
    assert suite.ignored_keys == () and suite.ungraded == ()
    assert len(suite.prompts) == 8
    first = suite.prompts[0]
    assert first == Prompt(suite="smoke", index=0, id="mul", text=first.text, answer="56")
    assert first.text.startswith("What is 7 times 8?") and first.text.endswith("\\boxed{}.")
    assert len({p.id for p in suite.prompts}) == 8
    assert load_suite("smoke", data_dir=Path("/nonexistent")).prompts == suite.prompts  # data dir unused


@needs_mirror
@pytest.mark.parametrize("name, count, first_id, first_answer", [("aime24", 30, "60", "204"), ("amc23", 40, "0", "27")])
def test_mirror_suites(name, count, first_id, first_answer):
    suite = load_suite(name, data_dir=MIRROR)
    assert suite.source == f"mirror:{name}.jsonl"
    assert len(suite.prompts) == count
    assert [p.index for p in suite.prompts] == list(range(count))
    assert len({p.id for p in suite.prompts}) == count
    assert (suite.prompts[0].id, suite.prompts[0].answer) == (first_id, first_answer)
    assert all(p.text.endswith("put your final answer within \\boxed{}.") for p in suite.prompts)
    assert all(p.answer and p.suite == name for p in suite.prompts)
    # every reference answer parses and grades as correct against itself
    assert all(is_correct(f"\\boxed{{{p.answer}}}", p.answer) for p in suite.prompts)


@needs_mirror
def test_amc23_float_answers_print_as_integers():
    answers = [p.answer for p in load_suite("amc23", data_dir=MIRROR).prompts]
    assert "3159" in answers and not any(a.endswith(".0") for a in answers)


@needs_mirror
def test_limit_and_checksums():
    full = load_suite("aime24", data_dir=MIRROR)
    again = load_suite("aime24", data_dir=str(MIRROR))
    five = load_suite("aime24", data_dir=MIRROR, limit=5)
    assert full.checksum == again.checksum and len(full.checksum) == 64
    assert five.prompts == full.prompts[:5]
    assert five.checksum == full.checksum  # the checksum covers the source; record the limit beside it
    assert load_suite("aime24", data_dir=MIRROR, limit=100).prompts == full.prompts
    assert load_suite("amc23", data_dir=MIRROR).checksum != full.checksum


def test_checksum_follows_the_data(tmp_path):
    suite_yaml = _suite_yaml(tmp_path)
    _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "1"}'])
    before = load_suite(str(suite_yaml), data_dir=tmp_path).checksum
    _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "2"}'])
    assert load_suite(str(suite_yaml), data_dir=tmp_path).checksum != before


def test_load_by_path_uses_task_name():
    suite = load_suite(str(SUITES_DIR / "smoke.yaml"))
    assert suite.name == "smoke" and len(suite.prompts) == 8
    # by name or by path, the checksum is the file's (its rows are inline: no data bytes)
    file_hash = hashlib.sha256((SUITES_DIR / "smoke.yaml").read_bytes() + b"\0").hexdigest()
    assert suite.checksum == load_suite("smoke").checksum == file_hash


# --------------------------------------------------------------------------------------------
# the hub (never reached in tests: HF_DATASETS_OFFLINE=1; where rows must come from it, load_dataset is
# replaced by a stand-in that returns them)


def test_no_data_dir_and_no_hub_says_pass_data_dir(monkeypatch, tmp_path):
    """The real `datasets.load_dataset`, offline (conftest) and with an empty cache (whatever this machine
    cached): the error says which hub id failed and what to pass instead."""
    import datasets

    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    message = _error(load_suite, "aime24")
    assert "HuggingFaceH4/aime_2024" in message
    assert "--data-dir" in message and "DETAUDIT_DATA_DIR" in message and "aime24.jsonl" in message


def test_hub_rows(monkeypatch):
    import datasets

    calls = []

    def fake_hub(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        return datasets.Dataset.from_list([{"id": 7, "question": "What is 1 + 1?", "answer": 2.0}])

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    suite = load_suite("amc23")
    assert calls == [("math-ai/amc23", None, "test", {})]
    assert suite.source == "hub:math-ai/amc23"
    assert [(p.id, p.answer) for p in suite.prompts] == [("7", "2")]


# --------------------------------------------------------------------------------------------
# bad input: one clear line each


def _suite_yaml(tmp_path: Path, body: str | None = None, name: str = "mine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(
        body
        if body is not None
        else (
            "task: mine\n"
            "dataset_path: someone/mine\n"
            "test_split: test\n"
            "local_file: mine.jsonl\n"
            'doc_to_text: "{{q}}"\n'
            'doc_to_target: "{{a}}"\n'
            'doc_to_id: "{{id}}"\n'
        )
    )
    return path


def _write_jsonl(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_custom_suite_from_jsonl(tmp_path):
    _write_jsonl(tmp_path, ['{"id": "a", "q": "one?", "a": 1}', "", '{"id": "b", "q": "two?", "a": "2"}'])
    suite = load_suite(str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    assert suite.name == "mine" and suite.source == "mirror:mine.jsonl"
    assert [(p.index, p.id, p.text, p.answer) for p in suite.prompts] == [(0, "a", "one?", "1"), (1, "b", "two?", "2")]


def test_unknown_suite():
    message = _error(load_suite, "aime2024")
    assert "unknown suite 'aime2024'" in message and "aime24, amc23, quote, smoke" in message


def test_missing_suite_file(tmp_path):
    assert "does not exist" in _error(load_suite, str(tmp_path / "nope.yaml"))


def test_malformed_yaml(tmp_path):
    path = _suite_yaml(tmp_path, "task: mine\ndoc_to_text: [unclosed\n")
    message = _error(load_suite, str(path))
    assert str(path) in message and "malformed YAML" in message and "line" in message


def test_yaml_not_a_mapping(tmp_path):
    assert "mapping" in _error(load_suite, str(_suite_yaml(tmp_path, "- a\n- b\n")))


def test_missing_required_keys(tmp_path):
    message = _error(load_suite, str(_suite_yaml(tmp_path, "task: mine\ndocs: [{q: x}]\n")))
    assert "missing required key(s) doc_to_text" in message
    message = _error(load_suite, str(_suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\n')))
    assert "dataset_path, test_split" in message and "docs" in message


def test_unknown_key(tmp_path):
    path = _suite_yaml(tmp_path, 'task: mine\ndoc_to_txt: "{{q}}"\ndoc_to_text: "{{q}}"\ndocs: [{q: x}]\n')
    assert "unsupported key(s) doc_to_txt" in _error(load_suite, str(path))


def test_bad_template(tmp_path):
    path = _suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q"\ndocs: [{q: x}]\n')
    assert "`doc_to_text` is not a valid Jinja2 template" in _error(load_suite, str(path))


def test_bad_task_name(tmp_path):
    path = _suite_yaml(tmp_path, 'task: "a/b"\ndoc_to_text: "{{q}}"\ndocs: [{q: x}]\n')
    assert "`task` must be a name" in _error(load_suite, str(path))


def test_jsonl_bad_line(tmp_path):
    data = _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "1"}', "", '{"id": 2, "q": "b?", "a": '])
    message = _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    assert f"{data}, line 3: not valid JSON" in message


def test_jsonl_line_not_an_object(tmp_path):
    data = _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "1"}', "[1, 2]"])
    assert f"{data}, line 2: expected a JSON object" in _error(
        load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path
    )


def test_empty_suite(tmp_path):
    _write_jsonl(tmp_path, [])
    assert "no prompts" in _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    inline = _suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\ndocs: []\n', name="inline.yaml")
    assert "no prompts" in _error(load_suite, str(inline))


def test_rows_without_answer_are_ungraded(tmp_path):
    _write_jsonl(
        tmp_path,
        [
            '{"id": 1, "q": "a?", "a": "1"}',
            '{"id": 2, "q": "b?"}',
            '{"id": 3, "q": "c?", "a": null}',
            '{"id": 4, "q": "d?", "a": "  "}',
            '{"id": 5, "q": "e?", "a": 0}',
        ],
    )
    suite = load_suite(str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    assert [(p.id, p.answer) for p in suite.prompts] == [("1", "1"), ("2", None), ("3", None), ("4", None), ("5", "0")]
    assert suite.ungraded == ("2", "3", "4")


def test_inline_row_without_answer_is_ungraded(tmp_path):
    path = _suite_yaml(
        tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\ndocs: [{q: x, a: 1}, {q: y}]\n'
    )
    suite = load_suite(str(path))
    assert [p.answer for p in suite.prompts] == ["1", None] and suite.ungraded == ("1",)


def test_suite_without_target_has_no_ungraded_list(tmp_path):
    suite = load_suite(str(_suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\ndocs: [{q: x}]\n')))
    assert suite.prompts[0].answer is None and suite.ungraded == ()


def test_target_field_that_no_row_has_is_refused(tmp_path):
    path = _suite_yaml(
        tmp_path,
        'task: mine\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{answr}}"\ndocs: [{q: x, answer: 1}, {q: y, answer: 2}]\n',
    )
    message = _error(load_suite, str(path))
    assert "`doc_to_target: {{answr}}` names a field no row has" in message and "answr" in message


def test_prompt_field_missing_names_the_row(tmp_path):
    data = _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "1"}', '{"id": 2, "a": "2"}'])
    message = _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    assert f"{data}, line 2" in message and "doc_to_text" in message and "'q' is undefined" in message


def test_prompt_field_null_names_the_row(tmp_path):
    data = _write_jsonl(tmp_path, ['{"id": 1, "q": null, "a": "1"}'])
    message = _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    assert f"{data}, line 1" in message and "null" in message


def test_duplicate_ids(tmp_path):
    _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "1"}', '{"id": 1, "q": "b?", "a": "2"}'])
    assert "id '1' repeats" in _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)


def test_missing_data_dir(tmp_path):
    message = _error(load_suite, "aime24", data_dir=tmp_path / "absent")
    assert "absent" in message and "does not exist" in message


def test_missing_mirror_file(tmp_path):
    assert f"data dir {tmp_path} has no aime24.jsonl" in _error(load_suite, "aime24", data_dir=tmp_path)


def test_unreadable_files(tmp_path):
    (tmp_path / "mine.jsonl").write_bytes(b'{"id": 1, "q": "\xff", "a": "1"}\n')
    assert "not UTF-8" in _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    (tmp_path / "dir.yaml").mkdir()
    assert "is a directory" in _error(load_suite, str(tmp_path / "dir.yaml"))


def test_bad_limit():
    assert "--limit must be >= 1" in _error(load_suite, "smoke", limit=0)


# --------------------------------------------------------------------------------------------
# chat template and hashes


PROMPT = Prompt(suite="smoke", index=0, id="mul", text="What is 7 times 8?", answer="56")


class FakeTokenizer:
    """A stand-in for a Hugging Face tokenizer: one id per character, a two-token chat frame."""

    chat_template = "fake"

    def __init__(self, returns: str = "list"):
        self.returns = returns
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        self.calls.append((messages, add_generation_prompt, tokenize))
        ids = [1] + [ord(c) for c in messages[0]["content"]] + ([2] if add_generation_prompt else [])
        if self.returns == "dict":  # transformers 5 returns a BatchEncoding (a dict) by default
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if self.returns == "batch":
            return [ids]
        return ids


@pytest.mark.parametrize("returns", ["list", "dict", "batch"])
def test_prompt_token_ids_with_fake_tokenizer(returns):
    tok = FakeTokenizer(returns)
    ids = prompt_token_ids(tok, PROMPT)
    assert ids == [1] + [ord(c) for c in PROMPT.text] + [2]
    assert tok.calls == [([{"role": "user", "content": PROMPT.text}], True, True)]


def _tiny_real_tokenizer(chat_template: str | None):
    # built offline with the `tokenizers` library (no hub): a word-level vocabulary
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        w: i for i, w in enumerate(["[UNK]", "<|user|>", "<|assistant|>", "<|end|>", "What", "is", "7", "times", "8?"])
    }
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = chat_template
    return tok


def test_prompt_token_ids_with_real_tokenizer():
    template = (
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    ids = prompt_token_ids(_tiny_real_tokenizer(template), PROMPT)
    assert ids == [1, 4, 5, 6, 7, 8, 3, 2]


def test_prompt_token_ids_without_chat_template():
    assert prompt_token_ids(_tiny_real_tokenizer(None), PROMPT) == [4, 5, 6, 7, 8]


def test_prompt_token_ids_rejects_garbage():
    class Broken(FakeTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            return "not ids"

    assert "token ids" in _error(prompt_token_ids, Broken(), PROMPT)


def test_hashes():
    h = prompt_hash([1, 2, 3])
    assert h == prompt_hash([1, 2, 3]) and len(h) == 16 and int(h, 16) >= 0
    assert h != prompt_hash([1, 2, 4]) and h != prompt_hash([12, 3])


# --------------------------------------------------------------------------------------------
# lm-eval task files, in lm-evaluation-harness's own layout (lm_eval/tasks/<task>/<task>.yaml)

# lm_eval/tasks/gsm8k/gsm8k.yaml as lm-eval ships it (few-shot, from the hub)
GSM8K_YAML = r"""tag:
  - math_word_problems
task: gsm8k
dataset_path: gsm8k
dataset_name: main
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{question}}\nAnswer:"
doc_to_target: "{{answer}}" #" {{answer.split('### ')[-1].rstrip()}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore:
      - ","
      - "\\$"
      - "(?s).*#### "
      - "\\.$"
generation_kwargs:
  until:
    - "Question:"
    - "</s>"
    - "<|im_end|>"
  do_sample: false
  temperature: 0.0
repeats: 1
num_fewshot: 5
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\-?[0-9\\.\\,]+)"
      - function: "take_first"
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"
      - function: "take_first"
metadata:
  version: 3.0
"""

# a zero-shot variant next to it, the way lm-eval's variants inherit (`include:`), reading local rows
GSM8K_LOCAL_YAML = r"""include: gsm8k.yaml
task: gsm8k_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: data/test.jsonl
num_fewshot: 0
doc_to_target: "{{answer.split('####')[-1].strip()}}"
should_decontaminate: true
doc_to_decontamination_query: question
"""

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 6 eggs. How many eggs are in 5 boxes?", "answer": "6 * 5 = 30\n#### 30"},
    {"question": "What is 10 minus 4?", "answer": "#### 6"},
]


def _lm_eval_tree(tmp_path: Path) -> Path:
    folder = tmp_path / "lm_eval" / "tasks" / "gsm8k"
    (folder / "data").mkdir(parents=True)
    (folder / "gsm8k.yaml").write_text(GSM8K_YAML)
    (folder / "gsm8k-local.yaml").write_text(GSM8K_LOCAL_YAML)
    (folder / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return folder


def test_lm_eval_gsm8k_as_shipped_is_refused_for_its_few_shot(tmp_path):
    message = _error(load_suite, str(_lm_eval_tree(tmp_path) / "gsm8k.yaml"))
    assert "refused" in message and "`num_fewshot: 5`" in message and "zero-shot" in message


def test_lm_eval_include_and_json_data_files(tmp_path, monkeypatch):
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"  # conftest: no dataset hub
    folder = _lm_eval_tree(tmp_path)
    monkeypatch.chdir(tmp_path)  # data_files are relative to the YAML, not to the working directory
    suite = load_suite(str(folder / "gsm8k-local.yaml"))
    assert suite.name == "gsm8k_local" and suite.source == "dataset:json"
    assert [p.text for p in suite.prompts] == [f"Question: {r['question']}\nAnswer:" for r in GSM8K_ROWS]
    assert [p.answer for p in suite.prompts] == ["7", "30", "6"]
    assert [p.id for p in suite.prompts] == ["0", "1", "2"] and suite.ungraded == ()
    assert suite.version == "3.0"
    assert suite.generation.to_dict() == {
        "until": ["Question:", "</s>", "<|im_end|>"],
        "do_sample": False,
        "temperature": 0.0,
    }
    # accepted but unused keys, listed once each (from both files); `output_type: generate_until` is honoured
    # (it gives what the file leaves out lm-eval's defaults), so it is not among them
    assert sorted(suite.ignored_keys) == sorted(
        [
            "tag",
            "training_split",
            "fewshot_split",
            "metric_list",
            "repeats",
            "num_fewshot",
            "filter_list",
            "should_decontaminate",
            "doc_to_decontamination_query",
        ]
    )
    assert len(set(suite.ignored_keys)) == len(suite.ignored_keys)
    # the checksum follows the data file and both YAML files
    data = folder / "data" / "test.jsonl"
    before = suite.checksum
    data.write_text(data.read_text().replace("#### 6", "#### 5"))
    changed = load_suite(str(folder / "gsm8k-local.yaml"))
    assert changed.checksum != before and changed.prompts[2].answer == "5"
    (folder / "gsm8k.yaml").write_text(GSM8K_YAML.replace("Answer:", "A:"))
    assert load_suite(str(folder / "gsm8k-local.yaml")).checksum != changed.checksum


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_lm_eval_local_formats(tmp_path, fmt):
    import pandas as pd

    frame = pd.DataFrame({"question": ["one?", "two?"], "answer": ["1", "2"]})
    file = tmp_path / "rows" / f"test.{fmt}"
    file.parent.mkdir()
    {
        "json": lambda: frame.to_json(file, orient="records", lines=True),
        "csv": lambda: frame.to_csv(file, index=False),
        "parquet": lambda: frame.to_parquet(file),
    }[fmt]()
    path = _suite_yaml(
        tmp_path,
        f"task: t_{fmt}\ndataset_path: {fmt}\ndataset_kwargs:\n  data_files: rows/test.{fmt}\n"
        "test_split: train\ndoc_to_text: question\ndoc_to_target: answer\n",
    )
    suite = load_suite(str(path))
    assert [(p.text, p.answer) for p in suite.prompts] == [("one?", "1"), ("two?", "2")]
    assert suite.source == f"dataset:{fmt}"


def test_data_dir_is_not_used_for_a_suite_without_local_file(tmp_path):
    folder = _lm_eval_tree(tmp_path)
    suite = load_suite(str(folder / "gsm8k-local.yaml"), data_dir=tmp_path / "elsewhere")
    assert suite.source == "dataset:json" and len(suite.prompts) == 3


def test_missing_data_files_named(tmp_path):
    path = _suite_yaml(
        tmp_path,
        "task: t\ndataset_path: json\ndataset_kwargs: {data_files: nope.jsonl}\ntest_split: train\ndoc_to_text: q\n",
    )
    message = _error(load_suite, str(path))
    assert "data_files" in message and "nope.jsonl" in message


def test_bare_column_names(tmp_path):
    path = _suite_yaml(
        tmp_path,
        "task: t\ndoc_to_text: question\ndoc_to_target: answer\ndoc_to_id: key\n"
        "docs: [{key: a, question: 'What is 2+2?', answer: 4}, {key: b, question: 'And 3+3?', answer: ''}]\n",
    )
    suite = load_suite(str(path))
    assert [(p.id, p.text, p.answer) for p in suite.prompts] == [("a", "What is 2+2?", "4"), ("b", "And 3+3?", None)]
    assert suite.ungraded == ("b",)


def test_bare_column_that_the_row_lacks_is_an_error_not_a_literal_prompt(tmp_path):
    path = _suite_yaml(tmp_path, "task: t\ndoc_to_text: questoin\ndocs: [{question: 'What is 2+2?'}]\n")
    message = _error(load_suite, str(path))
    assert "`doc_to_text: questoin` names a column the row lacks" in message and "question" in message


def test_int_target_and_validation_split(tmp_path):
    """The real `datasets.load_dataset` on local JSON splits: without a test split the validation split is
    read; with both, the test split (validation_split listed as ignored). An int target is the answer."""
    for split, question in (("dev", "from dev?"), ("test", "from test?")):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"q": question}) + "\n")
    files = "dataset_path: json\ndataset_kwargs: {data_files: {dev: dev.jsonl, test: test.jsonl}}\n"
    path = _suite_yaml(tmp_path, f"task: t\n{files}validation_split: dev\ndoc_to_text: q\ndoc_to_target: 3\n")
    suite = load_suite(str(path))
    assert [(p.text, p.answer) for p in suite.prompts] == [("from dev?", "3")]
    path = _suite_yaml(tmp_path, f"task: t\n{files}test_split: test\nvalidation_split: dev\ndoc_to_text: q\n")
    suite = load_suite(str(path))
    assert [p.text for p in suite.prompts] == ["from test?"] and suite.ignored_keys == ("validation_split",)


def test_dataset_path_not_required_with_local_file_or_docs(tmp_path):
    _write_jsonl(tmp_path, ['{"q": "a?"}'])
    path = _suite_yaml(tmp_path, "task: t\nlocal_file: mine.jsonl\ndoc_to_text: q\n")
    assert load_suite(str(path), data_dir=tmp_path).prompts[0].text == "a?"
    assert "--data-dir" in _error(load_suite, str(path))  # no dataset_path, no data dir: says what to pass
    inline = _suite_yaml(tmp_path, "task: t\ndoc_to_text: q\ndocs: [{q: 'b?'}]\n", name="inline.yaml")
    assert load_suite(str(inline)).prompts[0].text == "b?"


@pytest.mark.parametrize(
    "extra, named",
    [
        ("num_fewshot: 3\n", "`num_fewshot: 3`"),
        ("process_docs: !function utils.process_docs\n", "`process_docs`"),
        ("doc_to_choice: ['A', 'B']\n", "`doc_to_choice`"),
        ("output_type: multiple_choice\n", "`output_type: multiple_choice`"),
        ("output_type: loglikelihood\n", "`output_type: loglikelihood`"),
        ("description: 'Answer the following math question.\\n\\n'\n", "`description`"),
        ("gen_prefix: 'The answer is'\n", "`gen_prefix`"),
        ("repeats: 4\n", "`repeats: 4`"),
        ("use_prompt: promptsource:*\n", "`use_prompt`"),
        ("class: !function task.MyTask\n", "`class`"),
        ("dataset_kwargs: {trust_remote_code: true}\n", "trust_remote_code"),
    ],
)
def test_lm_eval_keys_that_change_prompts_are_refused_by_name(tmp_path, extra, named):
    path = _suite_yaml(tmp_path, 'task: t\ndoc_to_text: "{{q}}"\ndocs: [{q: x}]\n' + extra)
    message = _error(load_suite, str(path))
    assert "refused" in message and named in message


def test_function_in_a_prompt_field_is_refused(tmp_path):
    path = _suite_yaml(tmp_path, "task: t\ndoc_to_text: !function utils.doc_to_text\ndocs: [{q: x}]\n")
    message = _error(load_suite, str(path))
    assert "`doc_to_text: !function utils.doc_to_text` is refused" in message


def test_function_in_scoring_keys_is_ignored(tmp_path):
    path = _suite_yaml(
        tmp_path,
        'task: t\ndoc_to_text: "{{q}}"\ndocs: [{q: x}]\nprocess_results: !function utils.process_results\n'
        "metric_list: [{metric: !function utils.acc}]\ndescription: ''\nnum_fewshot: 0\n",
    )
    assert load_suite(str(path)).ignored_keys == ("process_results", "metric_list", "description", "num_fewshot")


def test_group_file_is_refused(tmp_path):
    path = _suite_yaml(tmp_path, "group: math\ntask: [gsm8k, minerva_math]\n")
    assert "group file" in _error(load_suite, str(path))


def test_include_errors(tmp_path):
    a = _suite_yaml(tmp_path, "include: b.yaml\ntask: a\n", name="a.yaml")
    _suite_yaml(tmp_path, "include: a.yaml\ndoc_to_text: q\n", name="b.yaml")
    assert "`include` cycle" in _error(load_suite, str(a))
    c = _suite_yaml(tmp_path, "include: ../missing.yaml\ntask: c\n", name="c.yaml")
    assert "`include: ../missing.yaml` names no file" in _error(load_suite, str(c))


def test_include_order_as_lm_eval(tmp_path):
    # the including file wins; of a list of includes, the earlier one wins
    _suite_yaml(tmp_path, "doc_to_text: first\ndocs: [{first: '1', second: '2', third: '3'}]\n", name="one.yaml")
    _suite_yaml(tmp_path, "doc_to_text: second\ndoc_to_target: second\n", name="two.yaml")
    path = _suite_yaml(tmp_path, "include: [one.yaml, two.yaml]\ntask: t\ndoc_to_target: third\n")
    prompt = load_suite(str(path)).prompts[0]
    assert (prompt.text, prompt.answer) == ("1", "3")


# --------------------------------------------------------------------------------------------
# --limit cuts rows before they are parsed or rendered


def _count_renders(monkeypatch) -> list:
    # (these suites' fields are columns and plain substitutions: they render in this process)
    from detaudit.inputs.suite_render import _Fields

    calls, real = [], _Fields.render
    monkeypatch.setattr(_Fields, "render", lambda self, f, row, label: calls.append(label) or real(self, f, row, label))
    return calls


def test_limit_renders_only_the_first_rows_of_a_large_jsonl(tmp_path, monkeypatch):
    row = '{"id": %d, "q": "What is %d plus 1?", "a": "%d"}'
    lines = [row % (i, i, i + 1) for i in range(200_000)] + ["{not json"]  # a bad last line is never parsed
    data = _write_jsonl(tmp_path, lines)
    calls = _count_renders(monkeypatch)
    suite = load_suite(str(_suite_yaml(tmp_path)), data_dir=tmp_path, limit=2)
    assert [p.id for p in suite.prompts] == ["0", "1"] and suite.prompts[1].answer == "2"
    assert len(calls) == 6 and set(calls) == {f"{data}, line 1", f"{data}, line 2"}  # text, id, answer of 2 rows
    assert len(suite.checksum) == 64  # the checksum still covers the whole file


def test_limit_renders_only_the_first_rows_of_a_dataset(tmp_path, monkeypatch):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"q": f"q{i}", "a": str(i)}) + "\n" for i in range(5000)))
    path = _suite_yaml(
        tmp_path,
        "task: t\ndataset_path: json\ndataset_kwargs: {data_files: rows.jsonl}\n"
        "test_split: train\ndoc_to_text: q\ndoc_to_target: a\n",
    )
    calls = _count_renders(monkeypatch)
    suite = load_suite(str(path), limit=3)
    assert [p.text for p in suite.prompts] == ["q0", "q1", "q2"] and len(calls) == 6


# --------------------------------------------------------------------------------------------
# prompt form: the chat template or plain text (lm-eval's default)

CHAT = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_plain_text_is_the_tokenized_prompt_without_the_template():
    tok = _tiny_real_tokenizer(CHAT)
    assert prompt_token_ids(tok, PROMPT, chat=False) == [4, 5, 6, 7, 8]
    assert prompt_token_ids(tok, PROMPT, chat=True) == [1, 4, 5, 6, 7, 8, 3, 2]


def test_builtin_suites_keep_the_chat_form_and_task_files_default_to_plain(tmp_path):
    from detaudit.inputs.prepare import chat_form

    assert all(load_suite(n, data_dir=MIRROR).apply_chat_template for n in ("smoke",))
    lm_eval = load_suite(str(_suite_yaml(tmp_path, "task: t\ndoc_to_text: q\ndocs: [{q: 'What is 7 times 8?'}]\n")))
    assert lm_eval.apply_chat_template is False
    tok = _tiny_real_tokenizer(CHAT)
    assert chat_form(lm_eval, tok, None) is False and chat_form(lm_eval, tok, True) is True
    assert chat_form(load_suite("smoke"), tok, None) is True and chat_form(load_suite("smoke"), tok, False) is False
    base = _tiny_real_tokenizer(None)  # a base model's tokenizer: no template
    assert chat_form(load_suite("smoke"), base, None) is False
    assert "has no chat template" in _error(chat_form, lm_eval, base, True)


def test_apply_chat_template_key_must_be_a_bool(tmp_path):
    path = _suite_yaml(tmp_path, "task: t\ndoc_to_text: q\ndocs: [{q: x}]\napply_chat_template: yes please\n")
    assert "`apply_chat_template` must be true or false" in _error(load_suite, str(path))


# --------------------------------------------------------------------------------------------
# local json rows: lazy, one-line errors


def _files_task(tmp_path: Path, fmt: str, data_files: str, split: str = "train") -> Path:
    body = f"task: t\ndataset_path: {fmt}\ndataset_kwargs: {{data_files: {data_files}}}\ntest_split: {split}\n"
    return _suite_yaml(tmp_path, body + "doc_to_text: q\n")


def test_json_limit_never_parses_a_bad_row_past_it(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"q": "one"}\n{"q": "two"}\n{not json\n')
    path = _files_task(tmp_path, "json", "rows.jsonl")
    assert [p.text for p in load_suite(str(path), limit=2).prompts] == ["one", "two"]
    message = _error(load_suite, str(path))
    assert message.startswith(f"{tmp_path / 'rows.jsonl'}, line 3: not valid JSON")


def test_json_array_and_field(tmp_path):
    (tmp_path / "rows.json").write_text('[{"q": "one"}, {"q": "two"}]')
    (tmp_path / "nested.json").write_text('{"data": [{"q": "three"}], "version": 1}')
    kw = "task: t\ndataset_path: json\ntest_split: train\ndoc_to_text: q\ndataset_kwargs: "
    assert [p.text for p in load_suite(str(_suite_yaml(tmp_path, kw + "{data_files: rows.json}\n"))).prompts] == [
        "one",
        "two",
    ]
    nested = _suite_yaml(tmp_path, kw + "{data_files: nested.json, field: data}\n")
    assert [p.text for p in load_suite(str(nested)).prompts] == ["three"]


def test_split_not_in_data_files_is_named(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"q": "one"}\n')
    path = _files_task(tmp_path, "json", "rows.jsonl", split="test")
    assert "split 'test' is not in `dataset_kwargs.data_files` (it has train" in _error(load_suite, str(path))


def test_a_malformed_csv_is_one_line_through_the_cli(tmp_path):
    from typer.testing import CliRunner

    from detaudit.cli import app

    (tmp_path / "bad.csv").write_text('q,a\n"x,1\n')
    path = _files_task(tmp_path, "csv", "bad.csv")
    result = CliRunner().invoke(app, ["suites", "show", str(path)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "could not read csv [train]" in lines[0], result.output


# --------------------------------------------------------------------------------------------
# suites show


def test_suites_show_keeps_backslashes_and_says_the_decoding(tmp_path):
    from typer.testing import CliRunner

    from detaudit.cli import app

    path = _suite_yaml(
        tmp_path,
        'task: t\ndoc_to_text: q\ndocs: [{q: "Find \\\\[ x \\\\] and [bold]y[/]"}]\n'
        "generation_kwargs: {until: ['Problem:'], max_gen_toks: 256, do_sample: false}\n",
    )
    result = CliRunner().invoke(app, ["suites", "show", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "Find \\[ x \\] and [bold]y[/]" in result.output
    assert "until: ['Problem:'], max_gen_toks: 256, do_sample: False" in result.output
    assert "plain text (lm-eval's default)" in result.output


def test_suites_show_says_which_decoding_keys_are_lm_evals_defaults(tmp_path):
    import json

    from typer.testing import CliRunner

    from detaudit.cli import app

    path = _suite_yaml(tmp_path, "task: t\ndoc_to_text: q\ndocs: [{q: x}]\ngeneration_kwargs: {max_gen_toks: 9}\n")
    result = CliRunner().invoke(app, ["suites", "show", str(path)], terminal_width=300)
    assert result.exit_code == 0, result.output
    assert "from the file: max_gen_toks: 9; lm-eval's defaults: until: ['\\n\\n']" in result.output
    shown = json.loads(CliRunner().invoke(app, ["suites", "show", str(path), "--json"]).stdout)
    assert shown["generation_kwargs"] == {"until": ["\n\n"], "max_gen_toks": 9}
    assert shown["generation_defaults"] == ["until"] and shown["ignored_keys"] == []


def test_gpt2_is_refused_by_its_architecture_first(tmp_path):
    """GPT-2 has no max_position_embeddings (n_positions): the built-in engine names the architecture;
    an engine that runs it reads n_positions as the context."""
    from detaudit.config import ModelRef
    from detaudit.inputs.prepare import PromptSet, check_model
    from detaudit.inputs.prompt_limits import model_context_len

    gpt2 = ModelRef("gpt2", tmp_path, "GPT2LMHeadModel", "0", {"model_type": "gpt2", "n_positions": 1024})
    ps = PromptSet("s", ["a"], [[1, 2, 3]], ["h"], [None], "c", "inline")
    message = _error(check_model, gpt2, [1], True, [ps], 16)
    assert "model_type 'gpt2' is not supported by the built-in engine" in message
    assert model_context_len(gpt2) == 1024
    check_model(gpt2, [1], False, [ps], 16)  # vLLM / servers: lengths checked against n_positions
