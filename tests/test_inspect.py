"""`headatlas inspect`: one text's matrices (known answers) and their figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.figure_checks import check_png

TEXT = "The cat sat on the mat. It was happy! Was it worth $5 or more? Nobody knows, said the dog."


@pytest.fixture(scope="module")
def params():
    from headatlas.service.analysis_options import build_params

    return build_params()


def reference_matrices(model, text: str):
    """C = z zᵀ (C_ii = 0) and A recomputed from Hugging Face outputs and the layers' weights,
    without the hooks: z_h = A_h V_h with V from the layer's input hidden state."""
    from headatlas.service.engine.model import model_blocks

    enc = model.tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.model(**enc, output_attentions=True, output_hidden_states=True)
        csm, attn = [], []
        for layer, block in enumerate(model_blocks(model.model)):
            a = out.attentions[layer][0].double()  # [head, pos, key]
            v = block.attention.self.value(out.hidden_states[layer])[0].double()  # [pos, head·d]
            v = v.view(v.shape[0], model.n_heads, -1).transpose(0, 1)  # [head, pos, d]
            z = a @ v
            c = z @ z.transpose(1, 2)
            c.diagonal(dim1=1, dim2=2).zero_()
            csm.append(c)
            attn.append(a)
    return torch.stack(csm).numpy(), torch.stack(attn).numpy(), enc["input_ids"][0].tolist()


def test_matrices_equal_an_independent_recomputation(tiny_model, params):
    from headatlas.service.reports.inspection import inspect_text

    insp = inspect_text(tiny_model, TEXT, params)
    csm, attn, ids = reference_matrices(tiny_model, TEXT)
    assert insp.token_ids.tolist() == ids
    assert insp.csm.shape == (tiny_model.n_layers, tiny_model.n_heads, len(ids), len(ids))
    assert np.allclose(insp.attention, attn, atol=1e-6)
    scale = np.abs(csm).max()
    assert np.allclose(insp.csm, csm, atol=1e-5 * scale)
    assert (np.diagonal(insp.csm, axis1=2, axis2=3) == 0).all()


def test_marked_pairs_are_the_pairs_the_stored_statistics_count(tiny_model, params):
    """Summing over the outlined pairs gives analyze_batch's numbers for the same window."""
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.corpus import Document, document_id
    from headatlas.service.engine.windows import TokenClasses, collate, document_windows
    from headatlas.service.reports.inspection import inspect_text

    insp = inspect_text(tiny_model, TEXT, params)
    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    doc = Document(document_id(TEXT), "t", 0, 1, TEXT)
    window = document_windows(doc, tiny_model.tokenizer, tokens, tiny_model.tokenizer_key, params)[0]
    result = analyze_batch(tiny_model, collate([window], tokens.pad_id), params, tokens)

    upper = np.triu(insp.high, k=1)  # [layer, head, pos, key], i < j
    assert np.array_equal(insp.high, insp.high.transpose(0, 1, 3, 2))
    assert np.array_equal(upper.sum(axis=(2, 3)), result.heads["high_pairs"])
    s = insp.sentence
    same_sentence = (s[:, None] == s[None, :]) & (s[:, None] >= 0)
    assert np.array_equal((upper & same_sentence).sum(axis=(2, 3)), result.heads["same_sentence_high"])
    for layer in range(tiny_model.n_layers):
        for head in range(tiny_model.n_heads):
            i, j = np.nonzero(upper[layer, head])
            hist = np.bincount(j - i, minlength=params.seq_len)
            assert np.array_equal(hist, result.dist_hist[layer, head])


def test_sentence_ids_and_boundaries(tiny_model, params):
    from headatlas.service.reports.inspection import inspect_text

    insp = inspect_text(tiny_model, "One two. Three four! Five?", params)
    assert insp.tokens == ["[CLS]", "one", "two", ".", "three", "four", "!", "five", "?", "[SEP]"]
    assert insp.sentence.tolist() == [-1, 0, 0, 0, 1, 1, 1, 2, 2, -1]
    assert insp.sentence_starts() == [4, 7]
    assert insp.in_pairs.tolist() == [False] + [True] * 8 + [False]
    assert not insp.truncated


def test_long_text_is_cut_to_one_window(tiny_model):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.reports.inspection import inspect_text

    insp = inspect_text(tiny_model, " ".join(["word"] * 100), build_params(seq_len=32))
    assert len(insp.tokens) == 32 and insp.truncated
    assert insp.tokens[0] == "[CLS]" and insp.tokens[-1] == "[SEP]"


def test_empty_text_and_bad_head_are_refused(tiny_model, params):
    from headatlas.service.errors import CorpusError, ParameterError
    from headatlas.service.reports import matrix_plots
    from headatlas.service.reports.inspection import inspect_text

    with pytest.raises(CorpusError, match="text is empty"):
        inspect_text(tiny_model, "  \n", params)
    insp = inspect_text(tiny_model, TEXT, params)
    with pytest.raises(ParameterError, match=r"--head 4: the model has heads 0\.\.3 \(0-based\)"):
        matrix_plots.figure_head(insp, 0, 4)
    with pytest.raises(ParameterError, match=r"--layer 2: the model has layers 0\.\.1"):
        matrix_plots.figure_grid(insp, layer=2)
    with pytest.raises(ParameterError, match="--head 1 needs --layer"):
        matrix_plots.check_layer_head(insp, None, 1)


@pytest.mark.slow
def test_head_figure_is_readable_at_128_tokens(real_model, demo_corpus, params, tmp_path):
    from headatlas.service.reports import matrix_plots, plots
    from headatlas.service.reports.inspection import inspect_text

    insp = inspect_text(real_model, demo_corpus.read_text(encoding="utf-8"), params)
    assert len(insp.tokens) == 128 and insp.truncated
    fig = matrix_plots.figure_head(insp, 4, 6)
    path = plots.save(fig, tmp_path / "head.png")
    width, height = matrix_plots.head_figsize(128)
    check_png(path, (round(width * plots.DPI), round(height * plots.DPI)))
    csm_ax, attn_ax = fig.axes[:2]
    for ax in (csm_ax, attn_ax):
        pitch = ax.get_window_extent().width / 128  # pixels per token on screen
        assert pitch >= matrix_plots.MIN_TOKEN_PX
        assert [t.get_text() for t in ax.get_xticklabels()] == insp.tokens
        assert [t.get_text() for t in ax.get_yticklabels()] == insp.tokens
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert len(dashed) == 2 * len(insp.sentence_starts()) > 0
    assert np.array_equal(csm_ax.images[0].get_array(), insp.csm[4, 6])
    marked = csm_ax.collections[0].get_offsets()
    assert len(marked) == insp.high[4, 6].sum() > 0


@pytest.mark.slow
def test_grid_figure_has_one_matrix_per_head(real_model, params, tmp_path):
    from headatlas.service.reports import matrix_plots, plots
    from headatlas.service.reports.inspection import inspect_text

    insp = inspect_text(real_model, TEXT, params)
    fig = matrix_plots.figure_grid(insp)
    images = [ax for ax in fig.axes if ax.images]
    assert len(images) == real_model.n_layers * real_model.n_heads
    check_png(plots.save(fig, tmp_path / "grid.png"), plots.pixel_size(fig))
    one_layer = matrix_plots.figure_grid(insp, layer=3, matrix="attention")
    assert len([ax for ax in one_layer.axes if ax.images]) == real_model.n_heads
    assert np.array_equal(one_layer.axes[5].images[0].get_array(), insp.attention[3, 5])


def test_inspect_command(cli, tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text(TEXT + "\n\nA second document, not shown.\n", encoding="utf-8")
    out = tmp_path / "head.png"
    done = cli(
        "inspect", "--file", str(corpus), "--model", "random:tiny", "--layer", "1", "--head", "2", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    check_png(out)
    refused = cli("inspect", "some text", "--file", str(corpus), "--out", str(tmp_path / "x.png"))
    assert refused.returncode == 2 and refused.stderr.startswith("error: inspect: pass the text")
    assert "Traceback" not in refused.stderr
