"""The retrieval and reranking evaluators against sentence-transformers' `InformationRetrievalEvaluator` and
`CrossEncoderRerankingEvaluator` on the same embeddings, scores and models; the `evaluate retrieval` command."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from sentence_transformers import CrossEncoder as TorchCrossEncoder
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Transformer
from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator as TheirIR
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import cos_sim, dot_score

from mlx_encoders import CrossEncoder, SentenceEncoder
from mlx_encoders.__main__ import main
from mlx_encoders.train import evaluators, fine_tune
from mlx_encoders.train.evaluators import InformationRetrievalEvaluator, RerankingEvaluator
from mlx_encoders.train.trainer import OptionError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FixedEmbeddings:
    """A stand-in sentence-transformers model whose embeddings are a table: both evaluators see the same vectors."""

    def __init__(self, table: dict[str, np.ndarray], similarity_fn_name: str = "cosine"):
        self.table, self.similarity_fn_name = table, similarity_fn_name
        self.similarity = {"cosine": cos_sim, "dot": dot_score}[similarity_fn_name]
        self.model_card_data = SimpleNamespace(set_evaluation_metrics=lambda *a: None)

    def encode_query(self, texts, **kwargs):
        return torch.tensor(np.stack([self.table[t] for t in texts]))

    encode_document = encode_query


def synthetic(seed: int = 0, n_queries: int = 12, n_docs: int = 40, dim: int = 8):
    """Integer-valued embeddings (exact dot products), with duplicate documents (exact score ties across ids in an
    order different from insertion order), queries with one to four relevant documents, one query with none and
    one relevant document that is never among the best 10."""
    rng = np.random.default_rng(seed)
    doc_vectors = rng.integers(-3, 4, size=(n_docs, dim)).astype(np.float32)
    doc_vectors[5] = doc_vectors[17] = doc_vectors[30]  # ties
    doc_vectors[8] = doc_vectors[2]
    query_vectors = rng.integers(-3, 4, size=(n_queries, dim)).astype(np.float32)
    query_vectors[3] = doc_vectors[17]  # its best documents are the three tied ones
    ids = [f"d{(7 * i) % n_docs:02d}" for i in range(n_docs)]  # not sorted: ties break by id, not position
    corpus = {cid: f"doc {cid}" for cid in ids}
    queries = {f"q{i}": f"query {i}" for i in range(n_queries)}
    relevant = {}
    for i in range(n_queries - 1):  # the last query has no relevant document: both evaluators leave it out
        count = 1 + i % 4
        relevant[f"q{i}"] = {ids[j] for j in rng.choice(n_docs, size=count, replace=False)}
    relevant["q3"] = {ids[17], ids[30], ids[0]}
    table = {corpus[cid]: v for cid, v in zip(ids, doc_vectors, strict=True)}
    table |= {queries[q]: v for q, v in zip(queries, query_vectors, strict=True)}
    return queries, corpus, relevant, table


@pytest.mark.parametrize("block", [None, 90], ids=["one-block", "blocks-of-2-queries"])
@pytest.mark.parametrize("function", ["cosine", "dot"])
@pytest.mark.parametrize(
    "ks", [{}, {"mrr_at_k": [1, 5], "ndcg_at_k": [3, 7], "map_at_k": [2, 10], "accuracy_at_k": [2]}]
)
def test_retrieval_metrics_equal_sentence_transformers_on_the_same_embeddings(monkeypatch, function, ks, block):
    if block:
        monkeypatch.setattr(evaluators, "SCORE_BLOCK", block)
    queries, corpus, relevant, table = synthetic()
    model = FixedEmbeddings(table, function)
    theirs = TheirIR(queries, corpus, relevant, write_csv=False, **ks)(model)
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, **ks)
    vectors = np.stack([table[queries[q]] for q in evaluator.query_ids]), np.stack([table[t] for t in corpus.values()])
    ours = evaluator.metrics(*vectors, [function])
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key] == pytest.approx(float(theirs[key]), abs=1e-12), key
    assert ours[f"{function}_ndcg@{max(ks.get('ndcg_at_k', [10]))}"] < 1  # not a trivially perfect ranking
    # score_functions given to the evaluator are what metrics() and metric_names() report, as theirs
    configured = InformationRetrievalEvaluator(queries, corpus, relevant, score_functions=[function], **ks)
    assert configured.metrics(*vectors) == ours and sorted(configured.metric_names()) == sorted(theirs)


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ir")
    checkpoint = make_checkpoint(root / "bert", "bert")
    model = SentenceTransformer(modules=[Transformer(str(checkpoint)), Pooling(32, pooling_mode="mean")], device="cpu")
    model.save(str(root / "st"))
    return root / "st"


TEXTS = [
    "The cat sat on the mat.", "Dogs chase balls in the park.", "Paris is the capital of France.",
    "Python is a programming language.", "The stock market fell today.", "Rain is expected tomorrow.",
    "The cat sat on the mat.", "Apples and oranges are fruit.", "A train leaves at noon.", "Music fills the hall.",
    "Berlin is the capital of Germany.", "Lists hold items in order.",
]  # fmt: skip


@pytest.mark.parametrize("options", [{}, {"query_prompt": "query: ", "corpus_prompt": "passage: ", "truncate_dim": 16}])
def test_evaluator_on_a_model_equals_sentence_transformers(st_folder, options):
    corpus = {f"c{i}": text for i, text in enumerate(TEXTS)}
    queries = {"q0": "where is the cat", "q1": "capital cities", "q2": "programming", "q3": "weather"}
    relevant = {"q0": {"c0", "c6"}, "q1": {"c2", "c10"}, "q2": {"c3", "c11"}, "q3": {"c5"}}
    model = SentenceTransformer(str(st_folder))
    theirs = TheirIR(queries, corpus, relevant, write_csv=False, name="dev", **options)(model)
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, name="dev", **options)
    ours = evaluator(SentenceEncoder(st_folder))
    assert sorted(ours) == sorted(theirs) and evaluator.primary_metric == "dev_cosine_ndcg@10"
    assert evaluator.metric_names() == list(ours)
    for key in theirs:
        assert ours[key] == pytest.approx(float(theirs[key]), abs=1e-9), key


def test_evaluate_retrieval_command(tmp_path, st_folder, capsys):
    corpus = {f"c{i}": text for i, text in enumerate(TEXTS)}
    queries = {"q0": "where is the cat", "q1": "capital cities"}
    relevant = {"q0": {"c0", "c6"}, "q1": {"c2", "c10"}}
    write = lambda name, rows: (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))  # noqa: E731
    write("queries.jsonl", [{"_id": q, "text": t} for q, t in queries.items()])
    write("corpus.jsonl", [{"_id": c, "title": "", "text": t} for c, t in corpus.items()])
    write("qrels.jsonl", [{"query-id": q, "corpus-id": c, "score": 1} for q, cs in relevant.items() for c in cs])
    args = ["evaluate", "retrieval", "--model", str(st_folder), "--queries", str(tmp_path / "queries.jsonl"),
            "--corpus", str(tmp_path / "corpus.jsonl"), "--qrels", str(tmp_path / "qrels.jsonl"), "--json"]  # fmt: skip
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    theirs = TheirIR(queries, corpus, relevant, write_csv=False)(SentenceTransformer(str(st_folder)))
    assert printed == pytest.approx({k: float(v) for k, v in theirs.items()}, abs=1e-9)
    write("qrels.jsonl", [{"query-id": "q0", "corpus-id": "missing"}])
    assert main(args) == 1
    assert "corpus id 'missing'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- reranking
class FixedScores:
    """A stand-in CrossEncoder that returns given scores (both evaluators see the same numbers)."""

    def __init__(self, scores: dict[tuple[str, str], float]):
        self.scores = scores
        self.model_card_data = SimpleNamespace(set_evaluation_metrics=lambda *a: None)

    def predict(self, pairs, **kwargs):
        return np.array([self.scores[tuple(p)] for p in pairs], dtype=np.float32)


def reranking_samples(seed: int = 0):
    rng = np.random.default_rng(seed)
    samples, scores = [], {}
    for i in range(9):
        positive = [f"p{i}-{j}" for j in range(1 + i % 3)]
        negative = [f"n{i}-{j}" for j in range(3 + i % 5)]
        samples.append({"query": f"q{i}", "positive": positive if i % 2 else positive[0], "negative": negative})
        for doc in positive + negative:  # few distinct values: ties inside and across relevance levels
            scores[(f"q{i}", doc)] = float(rng.integers(0, 4))
    samples.append({"query": "q-none", "positive": [], "negative": ["x", "y"]})
    scores |= {("q-none", "x"): 1.0, ("q-none", "y"): 0.0}
    return samples, scores


def first_stage_samples(seed: int = 1):
    """Samples with a first-stage ranking ("documents"): some positives inside it, some missed, one with none."""
    rng = np.random.default_rng(seed)
    samples, scores = [], {}
    for i in range(8):
        positive = [f"p{i}-{j}" for j in range(1 + i % 3)]
        others = [f"o{i}-{j}" for j in range(4 + i % 4)]
        documents = others + positive[: (i % 3)] if i != 5 else others  # sample 5's first stage missed them all
        documents = [documents[j] for j in rng.permutation(len(documents))]
        samples.append({"query": f"q{i}", "positive": positive, "documents": documents})
        for doc in positive + others:
            scores[(f"q{i}", doc)] = float(rng.integers(0, 5))
    return samples, scores


@pytest.mark.parametrize(
    "at_k,case", [(10, "negatives"), (3, "negatives"), (10, "documents"), (3, "documents-only-retrieved")]
)
def test_reranking_metrics_equal_sentence_transformers_on_the_same_scores(at_k, case):
    samples, scores = reranking_samples() if case == "negatives" else first_stage_samples()
    options = {"always_rerank_positives": case == "documents", "at_k": at_k}
    theirs = CrossEncoderRerankingEvaluator(samples, write_csv=False, **options)(FixedScores(scores))
    ours = RerankingEvaluator(samples, **options)(FixedScores(scores))
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key] == pytest.approx(float(theirs[key]), abs=1e-12), key


def test_reranking_evaluator_on_a_model_equals_sentence_transformers(tmp_path):
    checkpoint = make_checkpoint(tmp_path, "bert", "sequence-classification", num_labels=1)
    samples = [
        {"query": "where is the cat", "positive": ["The cat sat on the mat."], "negative": TEXTS[1:5]},
        {"query": "capital cities", "positive": [TEXTS[2], TEXTS[10]], "negative": TEXTS[5:9]},
    ]
    theirs = CrossEncoderRerankingEvaluator(samples, name="dev", write_csv=False)(TorchCrossEncoder(str(checkpoint)))
    ours = RerankingEvaluator(samples, name="dev")(CrossEncoder(checkpoint))
    assert ours == pytest.approx({k: float(v) for k, v in theirs.items()}, abs=1e-9)


def test_evaluate_rerank_command(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "ce", "bert", "sequence-classification", num_labels=1)
    samples, _ = reranking_samples()
    samples = [{**s, "positive": [s["positive"]] if isinstance(s["positive"], str) else s["positive"]} for s in samples]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    args = ["evaluate", "rerank", "--model", str(checkpoint), "--samples", str(tmp_path / "samples.jsonl"), "--json"]
    assert main([*args, "--at-k", "5"]) == 0
    theirs = CrossEncoderRerankingEvaluator(samples, at_k=5, write_csv=False)(TorchCrossEncoder(str(checkpoint)))
    assert json.loads(capsys.readouterr().out) == pytest.approx({k: float(v) for k, v in theirs.items()}, abs=1e-9)


def test_one_text_or_id_as_a_str_is_one_not_its_characters():
    """A triplet row's `negative` (as `mine --format triplet` writes it) and a query's one relevant id as a str."""
    samples, scores = reranking_samples()
    triplets = [{**s, "negative": s["negative"][0]} for s in samples if s["positive"]]
    as_lists = [{**s, "negative": [s["negative"]]} for s in triplets]
    theirs = CrossEncoderRerankingEvaluator(as_lists, write_csv=False)(FixedScores(scores))
    assert RerankingEvaluator(triplets)(FixedScores(scores)) == pytest.approx({k: float(v) for k, v in theirs.items()})
    with pytest.raises(ValueError, match="sample 0: 'documents' is the first stage's ranked list of texts, got one"):
        RerankingEvaluator([{"query": "q", "positive": "p", "documents": "p"}])
    evaluator = InformationRetrievalEvaluator({"q": "x"}, {"doc1": "y", "d": "z"}, {"q": "doc1"})
    assert evaluator.relevant_docs == {"q": {"doc1"}}


def test_qrels_scores_written_as_numbers_in_strings_are_read(tmp_path):
    for name, row in {"queries": {"_id": "q0", "text": "where"}, "corpus": {"_id": "c0", "text": "here"},
                      "qrels": {"query-id": "q0", "corpus-id": "c0", "score": "1"}}.items():  # fmt: skip
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    read = evaluators.read_retrieval_files(*(tmp_path / f"{name}.jsonl" for name in ("queries", "corpus", "qrels")))
    assert read[2] == {"q0": {"c0"}}


@pytest.mark.parametrize(
    "file, line, message",
    [("queries", {"_id": "q0", "text": 123}, "'text' must be a str, got 123"),
     ("corpus", {"_id": "c0", "title": "Paris", "text": None}, "'text' must be a str, got None"),
     ("qrels", {"query-id": "q0", "corpus-id": "c0", "score": None}, "'score' must be a number, got None")],
)  # fmt: skip
def test_retrieval_files_values_of_the_wrong_kind_are_named_with_file_and_line(tmp_path, file, line, message):
    rows = {"queries": {"_id": "q0", "text": "where"}, "corpus": {"_id": "c0", "text": "here"},
            "qrels": {"query-id": "q0", "corpus-id": "c0", "score": 1}} | {file: line}  # fmt: skip
    for name, row in rows.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / file}.jsonl:1: {message}")):
        evaluators.read_retrieval_files(*(tmp_path / f"{name}.jsonl" for name in ("queries", "corpus", "qrels")))


def test_evaluators_name_bad_input():
    evaluator = InformationRetrievalEvaluator({"q": "x", "r": "z"}, {"d": "y", "e": "w"}, {"q": {"d"}, "r": {"e"}})
    with pytest.raises(ValueError, match=r"corpus_embeddings must be \(2, D\), .* got shape \(1, 4\)"):
        evaluator.metrics(np.ones((2, 4)), np.ones((1, 4)))
    with pytest.raises(ValueError, match=r"query_embeddings must be \(2, D\), .* got shape \(3, 4\)"):
        evaluator.metrics(np.ones((3, 4)), np.ones((2, 4)))
    reranking = RerankingEvaluator([{"query": "q", "positive": "p", "negative": ["n", "m"]}])
    with pytest.raises(ValueError, match=r"scores must hold 3 values, .* got shape \(2,\)"):
        reranking.metrics(np.ones(2))
    with pytest.raises(ValueError, match="No query has a relevant document"):
        InformationRetrievalEvaluator({"q": "x"}, {"d": "y"}, {})
    with pytest.raises(ValueError, match="ndcg_at_k"):
        InformationRetrievalEvaluator({"q": "x"}, {"d": "y"}, {"q": {"d"}}, ndcg_at_k=[0])
    with pytest.raises(ValueError, match="sample 0 needs 'query', 'positive' and one of"):
        RerankingEvaluator([{"query": "q", "positive": "p"}])
    with pytest.raises(ValueError, match=r"sample 0: 'negative' must be a text or a list of texts, got \[1, 2\]"):
        RerankingEvaluator([{"query": "q", "positive": "p", "negative": [1, 2]}])
    with pytest.raises(ValueError, match=r"sample 0: 'query' must be a text, got \['q'\]"):
        RerankingEvaluator([{"query": ["q"], "positive": "p", "negative": "n"}])


def test_empty_inputs_are_refused_naming_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="query 'q' has no relevant document in relevant_docs"):
        evaluators.retrieval_metrics([np.array([0.5, 0.1])], ["q"], ["d0", "d1"], {"q": set()})
    with pytest.raises(ValueError, match="no queries to score"):
        evaluators.retrieval_metrics([], [], ["d0"], {})
    with pytest.raises(ValueError, match="no documents to rank"):
        evaluators.retrieval_metrics([np.zeros(0)], ["q"], [], {"q": {"d0"}})
    with pytest.raises(ValueError, match="The corpus is empty"):
        InformationRetrievalEvaluator({"q": "x"}, {}, {"q": {"d"}})
    with pytest.raises(ValueError, match="RerankingEvaluator needs samples"):
        RerankingEvaluator([])
    with pytest.raises(ValueError, match="anchor-positive rows"):
        evaluators.row_retrieval_metrics([], [])
    files = {name: tmp_path / f"{name}.jsonl" for name in ("queries", "corpus", "qrels")}
    files["queries"].write_text(json.dumps({"_id": "q0", "text": "where is the cat"}) + "\n")
    files["corpus"].write_text(json.dumps({"_id": "c0", "text": "the cat is on the mat"}) + "\n")
    files["qrels"].write_text(json.dumps({"query-id": "Q0", "corpus-id": "c0", "score": 1}) + "\n")
    expected = f"{files['qrels']}: no query of {files['queries']} has a relevant document"
    with pytest.raises(ValueError, match=re.escape(expected)):
        evaluators.read_retrieval_files(*files.values())


def test_embed_training_reports_retrieval_metrics_equal_sentence_transformers_on_the_trained_folder(
    tmp_path, st_folder
):
    rows = [
        {"anchor": "where is the cat", "positive": TEXTS[0], "negative": TEXTS[4]},
        {"anchor": "capital cities", "positive": TEXTS[2], "negative": TEXTS[9]},
        {"anchor": "capital cities", "positive": TEXTS[10], "negative": TEXTS[4]},  # two relevant documents
        {"anchor": "programming", "positive": TEXTS[3], "negative": TEXTS[8]},
        {"anchor": "the weather", "positive": TEXTS[5], "negative": TEXTS[7]},
        {"anchor": "dogs outside", "positive": TEXTS[1], "negative": TEXTS[11]},
    ]
    trained = fine_tune(
        "embed", rows, tmp_path / "run", model=st_folder, eval_data=rows, max_steps=2, batch_size=3, lr=1e-3,
        metric_for_best="eval_cosine_ndcg@10",
    )  # fmt: skip
    queries = {f"q{i:09d}": q for i, q in enumerate(dict.fromkeys(r["anchor"] for r in rows))}
    texts = list(dict.fromkeys(t for r in rows for t in (r["positive"], r["negative"])))
    corpus = {f"d{i:09d}": t for i, t in enumerate(texts)}
    ids = {t: i for i, t in corpus.items()} | {q: i for i, q in queries.items()}
    relevant = {}
    for r in rows:
        relevant.setdefault(ids[r["anchor"]], set()).add(ids[r["positive"]])
    theirs = TheirIR(queries, corpus, relevant, write_csv=False)(SentenceTransformer(str(trained.path)))
    assert {k: v for k, v in trained.metrics.items() if k.startswith("eval_cosine")} == pytest.approx(
        {f"eval_{k}": float(v) for k, v in theirs.items()}, abs=1e-6
    )
    with pytest.raises(OptionError, match="eval_cosine_ndcg@10"):  # the metrics it names, to choose from
        fine_tune("embed", rows, tmp_path / "x", model=st_folder, eval_data=rows, metric_for_best="eval_ndcg")


def test_a_k_given_twice_is_one_metric_as_sentence_transformers_reports_it():
    queries, corpus, relevant, table = synthetic()
    model = FixedEmbeddings(table)
    ks = {"ndcg_at_k": [10], "precision_recall_at_k": [1, 5], "map_at_k": [100]}
    theirs = TheirIR(queries, corpus, relevant, write_csv=False, **ks)(model)
    twice = {"ndcg_at_k": [10, 10], "precision_recall_at_k": [1, 5, 5], "map_at_k": [100, 100]}
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, **twice)
    vectors = np.stack([table[queries[q]] for q in evaluator.query_ids]), np.stack([table[t] for t in corpus.values()])
    ours = evaluator.metrics(*vectors, ["cosine"])
    assert ours == pytest.approx({k: float(v) for k, v in theirs.items()}, abs=1e-12)


def test_sentence_transformers_evaluator_options_are_taken():
    queries, corpus, relevant, table = synthetic()
    model = FixedEmbeddings(table)
    options = dict(main_score_function="dot", corpus_chunk_size=100, write_csv=False)
    theirs_evaluator = TheirIR(
        queries, corpus, relevant, score_functions={"cosine": cos_sim, "dot": dot_score}, **options
    )
    theirs = theirs_evaluator(model)
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, score_functions=["cosine", "dot"], **options)
    ours = evaluator(SimpleNamespace(
        encode_query=lambda texts, *a, **k: np.stack([table[t] for t in texts]),
        encode_document=lambda texts, *a, **k: np.stack([table[t] for t in texts]),
        similarity_fn_name="cosine",
    ))  # fmt: skip
    assert ours == pytest.approx({k: float(v) for k, v in theirs.items()}, abs=1e-12)
    assert evaluator.primary_metric == theirs_evaluator.primary_metric == "dot_ndcg@10"
    assert ours["cosine_ndcg@10"] != ours["dot_ndcg@10"]  # the primary metric is the function asked for
    with pytest.raises(ValueError, match="main_score_function 'dot' is not one of score_functions"):
        InformationRetrievalEvaluator(queries, corpus, relevant, score_functions=["cosine"], main_score_function="dot")


def test_corpus_ids_of_kinds_that_do_not_compare_rank_as_sentence_transformers():
    rng = np.random.default_rng(3)
    ids = [1, "2", 3, "4", 5, "6"]
    corpus = {cid: f"doc {cid}" for cid in ids}
    queries = {"q0": "first", "q1": "second"}
    relevant = {"q0": {1, "4"}, "q1": {"2"}}
    table = {text: rng.standard_normal(8).astype(np.float32) for text in [*corpus.values(), *queries.values()]}
    theirs = TheirIR(queries, corpus, relevant, write_csv=False)(FixedEmbeddings(table))
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant)
    vectors = np.stack([table[queries[q]] for q in evaluator.query_ids]), np.stack([table[t] for t in corpus.values()])
    assert evaluator.metrics(*vectors, ["cosine"]) == pytest.approx({k: float(v) for k, v in theirs.items()})


def test_reranking_evaluator_takes_sentence_transformers_arguments_and_dict_samples():
    samples, scores = reranking_samples()
    by_name = {f"s{i}": sample for i, sample in enumerate(samples)}
    options = dict(name="dev", show_progress_bar=False, write_csv=False, mrr_at_k=5)
    theirs = CrossEncoderRerankingEvaluator(by_name, **options)(FixedScores(scores))
    ours = RerankingEvaluator(by_name, **options)(FixedScores(scores))
    assert "dev_ndcg@5" in ours and ours == pytest.approx({k: float(v) for k, v in theirs.items()}, abs=1e-12)
    given = {}

    class Recording(FixedScores):
        def predict(self, pairs, **kwargs):
            given.update(kwargs)
            return super().predict(pairs)

    RerankingEvaluator(samples, prompt_name="query", show_progress_bar=True)(Recording(scores))
    assert given["prompt_name"] == "query" and given["show_progress_bar"] is True


def test_a_qrels_row_marking_a_missing_document_not_relevant_is_read(tmp_path):
    rows = {
        "queries": [{"_id": "q0", "text": "where"}],
        "corpus": [{"_id": "c0", "text": "here"}],
        "qrels": [
            {"query-id": "q0", "corpus-id": "c0", "score": 1},
            {"query-id": "q0", "corpus-id": "gone", "score": 0},
        ],
    }
    for name, lines in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    read = evaluators.read_retrieval_files(*(tmp_path / f"{name}.jsonl" for name in ("queries", "corpus", "qrels")))
    assert read[2] == {"q0": {"c0"}}
    (tmp_path / "qrels.jsonl").write_text(json.dumps({"query-id": "q0", "corpus-id": "gone", "score": 1}) + "\n")
    with pytest.raises(ValueError, match="corpus id 'gone' .query 'q0'. is not in"):
        evaluators.read_retrieval_files(*(tmp_path / f"{name}.jsonl" for name in ("queries", "corpus", "qrels")))
