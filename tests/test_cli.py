"""`python -m mlx_encoders TASK ...`: the command line gives the pipelines' results, compared with transformers'
pipelines and sentence-transformers on the same checkpoints."""

import contextlib
import importlib.util
import io
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from checkpoints import MINILM, load_reference
from test_pipelines import reference_answers

from mlx_encoders.__main__ import main

EXAMPLE = Path(__file__).parent.parent / "examples" / "fill_mask.py"
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["I loved this film.", "Terrible service, never again!", "ok"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mlm(checkpoint):
    return checkpoint("bert", "masked-lm", initializer_range=0.5, seed=1)


@pytest.fixture(scope="module")
def classifier(checkpoint):
    return checkpoint("roberta", "sequence-classification", initializer_range=0.8, id2label=LABELS)


def run(capsys, *argv: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def reference(task: str, folder, head: str):
    return transformers.pipeline(task, model=load_reference(folder, head), tokenizer=str(folder))


def close(ours, ref, tol=1e-4):
    """Same structure and exact tokens/labels; scores within `tol`."""
    if isinstance(ref, dict):
        assert list(ours) == list(ref)
        for k in ref:
            close(ours[k], ref[k], tol)
    elif isinstance(ref, list):
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref, strict=True):
            close(a, b, tol)
    elif isinstance(ref, (float, np.floating)):  # token classification's scores are numpy floats
        assert abs(ours - ref) <= tol
    else:
        assert ours == ref


def test_fill_mask_json_from_arguments_and_stdin(capsys, monkeypatch, mlm):
    ref = reference("fill-mask", mlm, "masked-lm")
    texts = ["Paris is the [MASK] of France.", "A [MASK] and a [MASK]."]
    code, out, _ = run(capsys, "fill-mask", "--model", mlm, "--top-k", 3, "--json", *texts)
    assert code == 0
    entries = json.loads(out)
    assert [e["input"] for e in entries] == texts
    for entry, text in zip(entries, texts, strict=True):
        close(entry["result"], ref(text, top_k=3))
    code, piped, _ = run(capsys, "fill-mask", "-m", mlm, "--top-k", 3, "--json",
                         stdin="\n".join(texts) + "\n\n", monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0 and json.loads(piped) == entries
    # a file from Windows: CRLF line ends and a byte-order mark are no part of the texts
    code, windows, _ = run(capsys, "fill-mask", "-m", mlm, "--top-k", 3, "--json",
                           stdin="\ufeff" + "\r\n".join(texts) + "\r\n", monkeypatch=monkeypatch)  # fmt: skip
    assert code == 0 and json.loads(windows) == entries


def test_fill_mask_targets_are_one_comma_separated_value(capsys, mlm):
    """`--targets` once took every word after it, the text too; now it takes one value, and the text stays a text."""
    text = "Paris is the [MASK] of France."
    ref = reference("fill-mask", mlm, "masked-lm")(text, targets=["paris", "london"])
    code, out, _ = run(capsys, "fill-mask", "-m", mlm, "--targets", "paris,london", "--json", text)
    assert code == 0
    close(json.loads(out)[0]["result"], ref)
    code, again, _ = run(capsys, "fill-mask", "-m", mlm, "--targets", "paris", "--targets", "london", "--json", text)
    assert code == 0 and again == out
    code, _, err = run(capsys, "fill-mask", "-m", mlm, "--targets", "paris", "london", text)
    assert code == 1 and "No mask_token" in err and "'london'" in err  # london is a text now, and has no mask
    with pytest.raises(SystemExit):
        main(["fill-mask", "-m", str(mlm), "--targets", "paris,,london", text])
    assert "empty target" in capsys.readouterr().err


def strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_fill_mask_targets_keep_their_spaces_as_transformers_reads_them(capsys, checkpoint):
    """On a BPE model " list" (the word-start token) and "list" are different targets: the spaces stay as typed."""
    folder = checkpoint("roberta", "masked-lm", initializer_range=0.5)
    text = "Return the <mask> of values."
    ref = reference("fill-mask", folder, "masked-lm")(text, targets=[" list", "list"])
    code, out, _ = run(capsys, "fill-mask", "-m", folder, "--targets", " list,list", "--json", text)
    assert code == 0 and len({r["token"] for r in ref}) == 2
    close(json.loads(out)[0]["result"], ref)
    with pytest.raises(SystemExit):
        main(["fill-mask", "-m", str(folder), "--targets", "list, ", text])
    assert "empty target" in capsys.readouterr().err


def test_json_writes_non_finite_numbers_as_null(capsys, monkeypatch, mlm):
    """Python's json writes NaN and Infinity, which JSON lacks and strict parsers refuse."""
    import mlx_encoders.__main__ as cli

    results = [[{"score": float("nan"), "token": 1}, {"score": np.float32("inf"), "token": 2}]]
    monkeypatch.setitem(cli.TASKS, "fill-mask", lambda args, texts: (results, None))
    for extra in ([], ["--indent", "2"]):
        code, out, err = run(capsys, "fill-mask", "-m", mlm, "--json", *extra, "A [MASK].")
        assert code == 0 and strict_json(out)[0]["result"] == [{"score": None, "token": 1}, {"score": None, "token": 2}]
        assert err.count("warning") == 1 and "2 NaN or infinite number(s) written as null" in err


def test_fill_mask_table(capsys, mlm):
    ref = reference("fill-mask", mlm, "masked-lm")("Paris is the [MASK] of France.", top_k=2)
    code, out, _ = run(capsys, "fill-mask", "--model", mlm, "--top-k", 2, "Paris is the [MASK] of France.")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "Paris is the [MASK] of France."
    assert lines[1].split() == ["rank", "token", "score", "sequence"]
    for rank, (line, p) in enumerate(zip(lines[2:], ref, strict=True), start=1):
        assert line.split()[:3] == [str(rank), p["token_str"], f"{p['score']:.4f}"]


def test_classify_labels_pairs_and_rerank(capsys, classifier):
    ref = reference("text-classification", classifier, "sequence-classification")
    code, out, _ = run(capsys, "classify", "--model", classifier, "--top-k", 0, "--json", *TEXTS)
    assert code == 0
    close([e["result"] for e in json.loads(out)], ref(TEXTS, top_k=None))
    query = "Was the film good?"
    pairs = [{"text": query, "text_pair": t} for t in TEXTS]
    code, out, _ = run(capsys, "classify", "-m", classifier, "--query", query, "--json", *TEXTS)
    close([e["result"] for e in json.loads(out)], ref(pairs, top_k=1))
    code, out, _ = run(capsys, "classify", "-m", classifier, "--query", query, "--rerank", *TEXTS)
    relevant = [[s for s in r if s["label"] == "positive"][0]["score"] for r in ref(pairs, top_k=None)]
    order = np.argsort(relevant)[::-1]
    rows = [line.split(maxsplit=3) for line in out.splitlines()[1:]]
    assert [int(r[2]) for r in rows] == order.tolist()
    assert [r[3] for r in rows] == [TEXTS[i] for i in order]
    assert [float(r[1]) for r in rows] == pytest.approx([relevant[i] for i in order], abs=1e-4)
    code, out, _ = run(capsys, "classify", "-m", classifier, "--query", query, "--rerank", "--top-k", 2, *TEXTS)
    assert [line.split(maxsplit=3)[3] for line in out.splitlines()[1:]] == [TEXTS[i] for i in order[:2]]


def test_rerank_scores_as_the_cross_encoder_folder_says(capsys, checkpoint, tmp_path):
    """A reranker saved with an Identity activation ranks by its raw logits, as sentence-transformers' rank() does
    (not through the pipeline's default sigmoid); --function none/sigmoid replaces the activation."""
    from sentence_transformers import CrossEncoder as TorchCrossEncoder

    source = checkpoint("bert", "sequence-classification", num_labels=1, initializer_range=0.8)
    TorchCrossEncoder(str(source), activation_fn=torch.nn.Identity()).save(str(tmp_path / "ce"))
    query = "Was the film good?"
    expected = TorchCrossEncoder(str(tmp_path / "ce")).rank(query, TEXTS, return_documents=True)
    code, out, _ = run(capsys, "classify", "-m", tmp_path / "ce", "--query", query, "--rerank", "--json", *TEXTS)
    got = json.loads(out)
    assert code == 0 and [r["corpus_id"] for r in got] == [r["corpus_id"] for r in expected]
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    logits = [float(r["score"]) for r in expected]
    assert any(x < 0 or x > 1 for x in logits)  # raw logits, which no sigmoid gives
    assert [r["score"] for r in got] == pytest.approx(logits, rel=1e-4, abs=1e-5)
    code, out, _ = run(capsys, "classify", "-m", tmp_path / "ce", "--query", query, "--rerank", "--json",
                       "--function", "sigmoid", *TEXTS)  # fmt: skip
    sigmoid = [1 / (1 + np.exp(-x)) for x in logits]
    assert [r["score"] for r in json.loads(out)] == pytest.approx(sigmoid, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("top_k", [0, -1])
def test_classify_top_k_all_as_help_says(capsys, classifier, top_k):
    ref = reference("text-classification", classifier, "sequence-classification")
    code, out, _ = run(capsys, "classify", "--model", classifier, "--top-k", top_k, "--json", *TEXTS)
    assert code == 0 and "0 or -1: all" in subcommand_help("classify")
    close([e["result"] for e in json.loads(out)], ref(TEXTS, top_k=None))


def test_classify_refuses_other_negative_top_k(capsys, classifier):
    with pytest.raises(SystemExit) as stop:
        main(["classify", "-m", str(classifier), "--top-k", "-2", "text"])
    assert stop.value.code == 2 and "or 0 or -1 for all; got '-2'" in capsys.readouterr().err


def subcommand_help(name: str) -> str:
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        main([name, "--help"])
    return " ".join(out.getvalue().split())


NER_TEXTS = ["Angela Merkel met Emmanuel Macron in Strasbourg yesterday.", "Rome is old"]
BIO = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}


@pytest.mark.parametrize("strategy", ["simple", "none"])
def test_tokens_matches_transformers_ner(capsys, checkpoint, strategy):
    # test_pipelines' seeded tagger, which gives the words several labels
    tagger = checkpoint("bert", "token-classification", initializer_range=0.5, seed=1, id2label=BIO,
                        label2id={v: k for k, v in BIO.items()})  # fmt: skip
    ref = reference("token-classification", tagger, "token-classification")
    expected = ref(NER_TEXTS, aggregation_strategy=strategy)
    code, out, _ = run(capsys, "tokens", "-m", tagger, "--aggregation", strategy, "--json", *NER_TEXTS)
    assert code == 0 and len(expected[0]) > 1
    close([e["result"] for e in json.loads(out)], expected)
    code, out, _ = run(capsys, "tokens", "-m", tagger, "--aggregation", strategy, NER_TEXTS[1])
    key = "entity_group" if strategy != "none" else "entity"
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [r[0] for r in rows] == [e[key] for e in expected[1]] and [r[2] for r in rows] == [
        e["word"] for e in expected[1]
    ]


def test_answer_matches_transformers_question_answering(capsys, checkpoint):
    reader = checkpoint("bert", "question-answering", initializer_range=0.8)
    # transformers 5 has no question-answering pipeline: test_pipelines' copy of transformers 4's
    ref = (transformers.AutoTokenizer.from_pretrained(reader), load_reference(reader, "question-answering"))
    question, contexts = "Where does Anna live?", ["Anna lives in Berlin and works in Potsdam.", "Rome is old."]
    code, out, _ = run(capsys, "answer", "-m", reader, "-q", question, "-c", contexts[0], "--json", contexts[1])
    assert code == 0
    close([e["result"] for e in json.loads(out)], [reference_answers(ref, question, c) for c in contexts])
    code, out, _ = run(capsys, "answer", "-m", reader, "--question", question, "--top-k", 2, contexts[0])
    expected = reference_answers(ref, question, contexts[0], top_k=2)
    rows = out.splitlines()[2:]
    assert len(rows) == 2 and [r.split()[0] for r in rows] == ["1", "2"]
    assert all(e["answer"] in row for e, row in zip(expected, rows, strict=True))


def test_embed_matches_sentence_transformers(capsys):
    from sentence_transformers import SentenceTransformer

    code, out, _ = run(capsys, "embed", "--model", MINILM, "--normalize", "--json", *TEXTS)
    assert code == 0
    got = np.array([e["result"] for e in json.loads(out)])
    expected = SentenceTransformer(str(MINILM), device="cpu").encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    code, table, _ = run(capsys, "embed", "--model", MINILM, TEXTS[0])
    assert table.splitlines()[1].split()[:2] == ["384", f"{np.linalg.norm(got[0]):.4f}"]


def test_errors_are_reported_with_exit_code(capsys, monkeypatch, mlm, classifier):
    code, _, err = run(capsys, "fill-mask", "-m", mlm, "No mask in this one.")
    assert code == 1 and "No mask_token ([MASK]) found" in err
    code, _, err = run(capsys, "fill-mask", "-m", classifier, "A [MASK].")
    assert code == 1 and "needs a masked-lm head" in err and "'text-classification'" in err
    with pytest.raises(SystemExit) as exit_:  # a refused option, before the model loads
        run(capsys, "classify", "-m", "/no/such/model", "--rerank", "text")
    assert exit_.value.code == 2 and "--rerank needs --query" in capsys.readouterr().err
    code, _, err = run(capsys, "classify", "-m", MINILM, "--query", "q", "--rerank", "text")  # an embedder
    assert code == 1 and "this folder embeds texts (SentenceEncoder; `mlx-encoders embed`)" in err
    code, _, err = run(capsys, "classify", "-m", classifier, stdin="\n  \n", monkeypatch=monkeypatch)
    assert code == 1 and "no input" in err
    code, _, err = run(capsys, "embed", "-m", mlm.parent / "missing", "text")
    assert code == 1 and "missing" in err


def test_json_is_one_line_per_record(capsys, mlm):
    """A list with one record per line, so a 384-number embedding stays on one line; --indent spreads it out."""
    texts = ["Paris is the [MASK] of France.", "A [MASK] and a [MASK]."]
    for argv in (["fill-mask", "-m", mlm, "--top-k", 2], ["embed", "-m", MINILM]):
        code, out, _ = run(capsys, *argv, "--json", *texts)
        lines = out.splitlines()
        assert code == 0 and lines[0] == "[" and lines[-1] == "]" and len(lines) == len(texts) + 2
        assert [json.loads(line.removesuffix(","))["input"] for line in lines[1:-1]] == texts
        code, indented, _ = run(capsys, *argv, "--json", "--indent", 2, *texts)
        assert json.loads(indented) == json.loads(out) and len(indented.splitlines()) > 20
    assert len(json.loads(out)[0]["result"]) == 384
    for extra in (["--indent", "2"], ["--json", "--indent", "-2"]):  # no JSON to spread out, or no spacing
        with pytest.raises(SystemExit) as exit_:
            main(["embed", "-m", str(MINILM), *extra, "a text"])
        assert exit_.value.code == 2 and "--indent N (N >= 0) spreads out --json output" in capsys.readouterr().err


def test_wrong_head_names_the_subcommand_of_the_head(capsys, checkpoint, classifier):
    code, _, err = run(capsys, "fill-mask", "-m", checkpoint("bert"), "A [MASK].")
    assert code == 1 and "(an encoder head), which supports the 'feature-extraction' task" in err
    assert "(`mlx-encoders embed` on the command line)" in err
    code, _, err = run(capsys, "fill-mask", "-m", classifier, "A [MASK].")
    assert "(a sequence-classification head)" in err and "(`mlx-encoders classify` on the command line)" in err


def make_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


DAMAGES = {
    "tokenizer.json garbage": ("tokenizer.json", lambda f: f.write_text('{"model": {"type": "Nonsense"}}')),
    "tokenizer_config.json a folder": ("tokenizer_config.json", make_directory),
    "config.json a folder": ("config.json", make_directory),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_corrupt_checkpoint_is_a_one_line_error(capsys, tmp_path, mlm, name):
    file, damage = DAMAGES[name]
    folder = shutil.copytree(mlm, tmp_path / "damaged")
    damage(folder / file)
    code, out, err = run(capsys, "fill-mask", "-m", folder, "A [MASK].")
    assert code == 1 and out == ""
    assert err.startswith("mlx-encoders fill-mask: error: ") and err.count("\n") == 1 and str(folder / file) in err


def test_output_into_a_closed_pipe_ends_quietly(tmp_path, mlm):
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"Text {i} has a [MASK].\n" for i in range(200)))  # far more than a pipe holds
    command = f"{shlex.quote(sys.executable)} -m mlx_encoders fill-mask --json -m {shlex.quote(str(mlm))} | head -1"
    with texts.open() as stdin:
        done = subprocess.run(command, shell=True, stdin=stdin, capture_output=True, text=True)
    assert done.stdout == "[\n"
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "mlx_encoders", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    assert all(task in done.stdout for task in ("fill-mask", "classify", "embed"))


def load_example():
    spec = importlib.util.spec_from_file_location("fill_mask_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fill_mask_example_table_matches_transformers(capsys, mlm):
    """examples/fill_mask.py on a local checkpoint: the top tokens, logits and probabilities of transformers."""
    load_example().main(["The capital of France is [MASK].", "--model", str(mlm), "--top-k", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "prompt: The capital of France is [MASK]."
    rows = [line.split() for line in lines[lines.index("mask 1") + 2 :]]
    model = load_reference(mlm, "masked-lm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(mlm)
    inputs = tokenizer("The capital of France is [MASK].", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, inputs["input_ids"][0] == tokenizer.mask_token_id][0]
    top = torch.topk(logits, 4)
    probs = logits.softmax(-1)
    expected = [[str(r), repr(tokenizer.decode([int(i)])), f"{logits[i]:.3f}", f"{probs[i]:.4f}"]
                for r, i in enumerate(top.indices, start=1)]  # fmt: skip
    assert rows == expected


def test_fill_mask_example_shortcuts_resolve_to_hub_ids(capsys, mlm, hub_cache):
    example = load_example()
    assert example.SHORTCUTS["albert-xxlarge-v2"] == "albert/albert-xxlarge-v2"
    hub_cache("google-bert/bert-base-uncased", mlm)  # offline stand-in for the real checkpoint
    example.main(["A [MASK] day.", "--model", "bert-base", "--top-k", "2"])
    out = capsys.readouterr().out
    assert out.startswith("model: google-bert/bert-base-uncased\n") and len(out.splitlines()) == 7
    with pytest.raises(SystemExit, match="neither a local folder nor in the Hugging Face cache"):
        example.main(["A [MASK] day.", "--model", "modernbert-base"])


def test_a_command_that_prints_as_it_goes_ends_quietly_into_a_closed_pipe(checkpoint):
    """generate (like index search and evaluate) prints from its own runner: a reader gone (`| true`) ends it
    with 141 and no error line, as the pipeline tasks end."""
    model = shlex.quote(str(checkpoint("gpt2", "causal-lm")))
    prompts = "$'a\\nb\\nc'"  # three prompts, one a line
    command = f"{shlex.quote(sys.executable)} -m mlx_encoders generate -m {model} --max-new-tokens 4 {prompts} | true"
    done = subprocess.run(["bash", "-c", command + "; exit ${PIPESTATUS[0]}"], capture_output=True, text=True)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_convert_ends_quietly_into_a_closed_pipe(checkpoint, tmp_path):
    """`python -m convert ... | head -1`: every command run through `run_command` takes a closed pipe as its
    reader's choice (141, no error line), not as a failed conversion."""
    source = shlex.quote(str(checkpoint("bert")))
    output = shlex.quote(str(tmp_path / "q8"))
    options = f"-q --group-size 32 --no-calibration {source} --mlx-path {output}"
    command = f"{shlex.quote(sys.executable)} -m convert {options} | true"
    root = str(Path(__file__).parents[1])
    done = subprocess.run(["bash", "-c", command + "; exit ${PIPESTATUS[0]}"], capture_output=True, text=True,
                          cwd=root)  # fmt: skip
    assert done.returncode == 141 and "error" not in done.stderr, done.stderr
    assert (tmp_path / "q8" / "config.json").exists()  # written before the report met the closed pipe


@pytest.mark.parametrize(
    "argv",
    [
        ["fill-mask", "--top-k", "0", "x"],
        ["answer", "--top-k", "0", "--question", "q", "x"],
        ["embed", "--batch-size", "0", "x"],
        ["evaluate", "rerank", "--at-k", "0", "--samples", "s.jsonl"],
    ],
)
def test_counts_below_one_are_refused_options_before_any_model_loads(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "-m", "/no/such/model"])
    assert exit_.value.code == 2 and "must be a positive integer (1 or more), got '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tokens", "-m", "/no/such/model", "--stride", "-1", "text"], "--stride: must be a whole number"),
        (["tokens", "-m", "/no/such/model", "--stride", "4", "--aggregation", "none", "x"], "--stride needs an"),
        (["generate", "-m", "/no/such/model", "--max-new-tokens", "-5", "x"], "max_new_tokens must be an int >= 0"),
        (["generate", "-m", "/no/such/model", "--top-p", "2", "x"], "top_p"),
        (
            [
                "evaluate",
                "retrieval",
                "-m",
                "m",
                "--queries",
                "q",
                "--corpus",
                "c",
                "--qrels",
                "r",
                "--truncate-dim",
                "0",
            ],
            "--truncate-dim: must be a positive integer",
        ),
        (
            ["evaluate", "retrieval", "-m", "m", "--queries", "q", "--corpus", "c", "--qrels", "r", "--mrr-at-k", "0"],
            "--mrr-at-k: expected comma-separated positive integers",
        ),
    ],
)
def test_refused_option_values_exit_2_before_any_model_loads(capsys, argv, message):
    """As the docs say of every refused option (these exited 1, generate's after loading its model)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2 and message in capsys.readouterr().err
