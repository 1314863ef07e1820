import os
from pathlib import Path

import pytest

from detaudit.errors import DetauditError
from detaudit.grading import is_correct
from detaudit import paths
from detaudit.suites import Prompt, list_suites, load_suite, prompt_hash, prompt_token_ids

SUITES_DIR = paths.builtin_suites_dir()


def _mirror() -> Path:
    env = os.environ.get("DETAUDIT_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared/data/suites"


MIRROR = _mirror()
needs_mirror = pytest.mark.skipif(
    not (MIRROR / "aime24.jsonl").is_file() or not (MIRROR / "amc23.jsonl").is_file(),
    reason=f"suite mirror not found at {MIRROR} (set DETAUDIT_DATA_DIR to a directory holding aime24.jsonl, amc23.jsonl)",
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
    assert set(listed) == {"aime24", "amc23", "smoke"}
    assert listed["smoke"]["source"] == "inline" and listed["smoke"]["needs_data_dir"] is False
    assert listed["aime24"]["dataset_path"] == "HuggingFaceH4/aime_2024"
    assert listed["amc23"]["dataset_path"] == "math-ai/amc23"
    assert listed["aime24"]["needs_data_dir"] and listed["aime24"]["local_file"] == "aime24.jsonl"
    assert all(s["description"] and s["version"] == "1.0" for s in listed.values())


def test_smoke_suite_is_inline():
    suite = load_suite("smoke")
    assert suite.name == "smoke" and suite.source == "inline"
    assert suite.path == SUITES_DIR / "smoke.yaml"
    assert SUITES_DIR.parts[-3:] == ("detaudit", "data", "suites")  # package data, not the repository
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
    assert load_suite("smoke").checksum == load_suite("smoke").checksum


def test_checksum_follows_the_data(tmp_path):
    suite_yaml = _suite_yaml(tmp_path)
    _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "1"}'])
    before = load_suite(str(suite_yaml), data_dir=tmp_path).checksum
    _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "2"}'])
    assert load_suite(str(suite_yaml), data_dir=tmp_path).checksum != before


def test_load_by_path_uses_task_name():
    suite = load_suite(str(SUITES_DIR / "smoke.yaml"))
    assert suite.name == "smoke" and len(suite.prompts) == 8


# --------------------------------------------------------------------------------------------
# the hub (never reached in tests: datasets.load_dataset is replaced)


def test_no_data_dir_and_no_hub_says_pass_data_dir(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/aime_2024' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
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
    assert "unknown suite 'aime2024'" in message and "aime24, amc23, smoke" in message


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
    assert f"{data}, line 2: expected a JSON object" in _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)


def test_empty_suite(tmp_path):
    _write_jsonl(tmp_path, [])
    assert "no prompts" in _error(load_suite, str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    inline = _suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\ndocs: []\n', name="inline.yaml")
    assert "no prompts" in _error(load_suite, str(inline))


def test_rows_without_answer_are_ungraded(tmp_path):
    _write_jsonl(tmp_path, ['{"id": 1, "q": "a?", "a": "1"}', '{"id": 2, "q": "b?"}', '{"id": 3, "q": "c?", "a": null}',
                            '{"id": 4, "q": "d?", "a": "  "}', '{"id": 5, "q": "e?", "a": 0}'])
    suite = load_suite(str(_suite_yaml(tmp_path)), data_dir=tmp_path)
    assert [(p.id, p.answer) for p in suite.prompts] == [("1", "1"), ("2", None), ("3", None), ("4", None), ("5", "0")]
    assert suite.ungraded == ("2", "3", "4")


def test_inline_row_without_answer_is_ungraded(tmp_path):
    path = _suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{a}}"\ndocs: [{q: x, a: 1}, {q: y}]\n')
    suite = load_suite(str(path))
    assert [p.answer for p in suite.prompts] == ["1", None] and suite.ungraded == ("1",)


def test_suite_without_target_has_no_ungraded_list(tmp_path):
    suite = load_suite(str(_suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\ndocs: [{q: x}]\n')))
    assert suite.prompts[0].answer is None and suite.ungraded == ()


def test_target_field_that_no_row_has_is_refused(tmp_path):
    path = _suite_yaml(tmp_path, 'task: mine\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{answr}}"\ndocs: [{q: x, answer: 1}, {q: y, answer: 2}]\n')
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

    vocab = {w: i for i, w in enumerate(["[UNK]", "<|user|>", "<|assistant|>", "<|end|>", "What", "is", "7", "times", "8?"])}
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
