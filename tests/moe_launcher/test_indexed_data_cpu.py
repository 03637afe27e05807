"""Training on a real indexed dataset (--data-path .bin/.idx written with megatron's builder)."""

from _corpus import write_indexed_corpus
from _launch import TINY_MODEL, launch, tensorboard_scalars


def test_trains_on_indexed_dataset(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    write_indexed_corpus(prefix, vocab=512)
    model = [arg for arg in TINY_MODEL if arg != "--mock-data"]
    run = launch(2, [*model, "--data-path", prefix, "--split", "98,2,0", "--data-cache-path",
                     str(tmp_path / "cache"), "--expert-model-parallel-size", "2",
                     "--train-iters", "3", "--tensorboard-dir", str(tmp_path / "tb")]).check()
    # Made by megatron's builder: no prepare_data record, said once, not refused.
    assert run.log.count("1 dataset(s) have no prepare_data record") == 1, run.log[-3000:]
    losses = tensorboard_scalars(tmp_path / "tb", "lm loss")
    assert sorted(losses) == [1, 2, 3]
    assert any((tmp_path / "cache").rglob("*.npy")), "no dataset index was built"
