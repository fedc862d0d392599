"""lavo.hf: the native model under transformers' AutoModelForCausalLM, generate(), save/load and pipelines."""
import copy
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # no hub access from the tests, before transformers reads it
pytest.importorskip("transformers")
if torch.__version__ < "2.6":  # a TorchVersion: compared as a version, not as a string
    pytest.skip("transformers 5 needs torch 2.6 or later", allow_module_level=True)

import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline  # noqa: E402

import lavo.hf as H  # noqa: E402
from lavo.cache import LavoCache  # noqa: E402
from lavo.data import EOT, train_bpe  # noqa: E402
from lavo.generate import generate  # noqa: E402
from lavo.model import build_model  # noqa: E402
from lavo.registry import available_attentions, attention_class  # noqa: E402
from lavo.run import RunError  # noqa: E402
from lm_corpus import WORDS  # noqa: E402
from reference_checks import forward_calls  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the model settings the equivalence tests run on: LAVO, a sliding window and softmax with rotary positions
SETTINGS = {
    "lavo": dict(attention="lavo", attention_options={"window": 4}),
    "local": dict(attention="local", attention_options={"window": 4}),
    "softmax-rope": dict(attention="softmax", attention_options={}, position="rope"),
}


def native(vocab_size=61, **settings):
    torch.manual_seed(0)
    # a large init_std so that an untrained model's greedy continuations vary instead of repeating one token
    values = dict(vocab_size=vocab_size, dim=32, depth=2, heads=2, init_std=0.3, **SETTINGS["lavo"])
    return build_model({**values, **settings}).eval()


def wrapped(model, **config):
    return H.LavoLMForCausalLM.from_native(model, **config)  # in the native model's mode: eval


def hub_generate(model, prompt, max_new_tokens, **options):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, eos_token_id=None,
                         pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe([" ".join(WORDS * 20)], 300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A LAVO model with its tokenizer saved as a Hugging Face directory, and the native model."""
    model = native(tokenizer.vocab_size)
    directory = tmp_path_factory.mktemp("hub")
    ids = dict(bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id, pad_token_id=tokenizer.eot_id)
    wrapped(model, **ids).save_pretrained(directory)
    H.hub_tokenizer(tokenizer).save_pretrained(directory)
    return directory, model


def test_the_config_has_the_model_config_fields_and_defaults():
    from lavo.model import ModelConfig
    assert H.LavoLMConfig().model_config() == ModelConfig()
    config = H.LavoLMConfig(attention="local", attention_options={"window": 8}, dim=64, heads=8, depth=3)
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (64, 8, 3)
    with pytest.raises(ValueError, match="attention 'local' has no option 'rank'"):
        H.LavoLMConfig(attention="local", attention_options={"rank": 8})


def test_a_misspelt_setting_is_refused_and_other_unknown_keys_are_kept(tmp_path):
    """``depht=3`` was kept as an attribute beside the default depth 4 and the model built with 4 layers."""
    import json

    from transformers import AutoConfig
    for name, meant in (("depht", "depth"), ("num_layers", "num_hidden_layers"), ("attention_option",
                                                                                   "attention_options")):
        with pytest.raises(ValueError, match=f"^LavoLMConfig has no setting '{name}': did you mean '{meant}'\\?$"):
            H.LavoLMConfig(**{name: 3})
    H.LavoLMConfig(depth=3).save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "depht": 2}))
    with pytest.raises(ValueError, match="^LavoLMConfig has no setting 'depht': did you mean 'depth'\\?$"):
        AutoConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**values, "converted_by": "a tool"}))
    assert AutoConfig.from_pretrained(tmp_path).converted_by == "a tool"  # metadata, kept as transformers keeps it


@pytest.mark.parametrize("rank", [16, 4])  # square and wide bases: the two maps of the parametrization
def test_a_learned_basis_saves_and_loads_in_float32_and_bfloat16(rank, tmp_path):
    # transformers builds the model on the meta device, where the basis's base had no key and stayed None
    model = native(attention_options={"window": 4, "basis": "learned", "rank": rank})
    wrapped(model).save_pretrained(tmp_path)
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        expected = model(ids)[0]
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
            torch.testing.assert_close(loaded(ids).logits.float(), expected, rtol=0, atol=tolerance)


def test_logits_to_keep_selects_the_returned_logits_and_the_loss_stays_over_all():
    """As in transformers: the last n positions, all for 0, or the positions a tensor lists (was ignored: every
    position came back)."""
    model = wrapped(native(**SETTINGS["lavo"]))
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        full = model(ids, labels=ids)
        for keep, positions in ((0, slice(None)), (1, slice(8, None)), (3, slice(6, None)),
                                (torch.tensor([0, 4]), [0, 4])):
            out = model(ids, labels=ids, logits_to_keep=keep)
            torch.testing.assert_close(out.logits, full.logits[:, positions], rtol=0, atol=0)
            assert out.loss == full.loss


@pytest.mark.parametrize("name", SETTINGS)
def test_logits_and_loss_equal_the_native_model(name):
    model = native(**SETTINGS[name])
    ids = torch.randint(0, 61, (2, 23))
    with torch.no_grad():
        expected, _ = model(ids)
        out = wrapped(model)(ids, labels=ids)
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-5)
    loss = torch.nn.functional.cross_entropy(expected[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, loss)


@pytest.mark.parametrize("how", [dict(), dict(every_n_layers=2),
                                 dict(activation_checkpointing_kwargs={"use_reentrant": True})])
def test_activation_checkpointing_recomputes_the_native_blocks_with_the_same_gradients(how):
    model = wrapped(native(depth=3, dropout=0.1)).train()
    ids = torch.randint(0, 61, (2, 23))

    def gradients():
        torch.manual_seed(1)
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]
    expected = gradients()
    model.activation_checkpointing_enable(**how)
    assert model.is_activation_checkpointing
    calls = forward_calls([block.attention for block in model.lavo.blocks])
    for got, want in zip(gradients(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    every = how.get("every_n_layers", 1)
    assert calls == [2 if i % every == 0 else 1 for i in range(3)]  # the checkpointed blocks ran again
    model.activation_checkpointing_disable()
    assert not model.is_activation_checkpointing


@pytest.mark.parametrize("name", available_attentions())
def test_every_mechanism_saves_loads_and_generates_like_the_native_loop(name, tmp_path):
    settings = dict(attention=name, attention_options={}, position="none")
    if "window" in attention_class(name).option_names():
        settings["attention_options"] = {"window": 4}
    model = native(**settings)
    wrapped(model).save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).attention == name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, H.LavoLMForCausalLM)
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids)[0], rtol=0, atol=1e-5)
    prompt = ids[0].tolist()
    assert hub_generate(loaded, prompt, 6, do_sample=False) == generate(model, prompt, 6, temperature=0)[0]


@pytest.mark.parametrize("name", SETTINGS)
def test_greedy_generate_equals_the_native_decoding_loop(name):
    model = native(**SETTINGS[name])
    prompt = [5, 6, 7, 8, 9]
    ours = generate(model, prompt, 30, temperature=0)[0]
    assert len(set(ours)) > 3  # a continuation that varies, so that agreement means something
    assert hub_generate(wrapped(model), prompt, 30, do_sample=False) == ours


def test_a_streamer_gets_each_token_before_the_next_forward_pass_and_its_text_joins_to_the_output(saved):
    """transformers' TextStreamer prints a LAVO model's generation as it goes, as `lavo generate` does."""
    directory, _ = saved
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    calls = forward_calls([model])
    received, pieces = [], []

    class Recorder(TextStreamer):
        def put(self, value):
            received.append((value.flatten().tolist(), calls[0]))
            super().put(value)

        def on_finalized_text(self, text, stream_end=False):
            pieces.append(text)

    prompt = tokenizer("the cat sat", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                         streamer=Recorder(tokenizer))
    new = out[0, prompt.input_ids.shape[1]:].tolist()
    assert len(new) == 12 and len(set(new)) > 1
    assert received == [(prompt.input_ids[0].tolist(), 0)] + [([token], i + 1) for i, token in enumerate(new)]
    assert "".join(pieces) == tokenizer.decode(out[0])


def test_sampling_with_temperature_top_k_top_p():
    model = wrapped(native())
    prompt = [5, 6, 7]
    greedy = hub_generate(model, prompt, 20, do_sample=False)
    options = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(1)
    first = hub_generate(model, prompt, 20, **options)
    torch.manual_seed(1)
    assert hub_generate(model, prompt, 20, **options) == first
    assert first != greedy  # this seed draws something other than the most likely token
    assert hub_generate(model, prompt, 20, do_sample=True, top_k=1) == greedy  # one candidate left: greedy
    assert hub_generate(model, prompt, 20, do_sample=True, top_p=1e-6) == greedy


@pytest.mark.parametrize("name", ["lavo", "softmax-rope"])
def test_beam_search_reorders_the_state(name):
    """The score beam search accumulated through the reordered state equals a fresh pass over each returned
    sequence: with a state reordered wrongly, a beam would continue another beam's context."""
    model = native(**SETTINGS[name])
    prompt = [5, 6, 7, 8]
    out = wrapped(model).generate(torch.tensor([prompt]), max_new_tokens=12, num_beams=3, num_return_sequences=3,
                                  do_sample=False, length_penalty=0.0, eos_token_id=None, pad_token_id=0,
                                  return_dict_in_generate=True, output_scores=True)
    sequences = out.sequences
    assert sequences.shape == (3, 16) and len({tuple(s) for s in sequences.tolist()}) == 3
    assert (sequences[:, :4] == torch.tensor(prompt)).all() and 0 <= sequences.min() and sequences.max() < 61
    with torch.no_grad():
        logits, _ = model(sequences[:, :-1])
    log_probs = logits.log_softmax(-1).gather(-1, sequences[:, 1:, None])[:, 3:, 0].sum(1)
    torch.testing.assert_close(out.sequences_scores, log_probs, rtol=0, atol=1e-4)
    assert out.sequences_scores[0] >= out.sequences_scores[1] >= out.sequences_scores[2]


@pytest.mark.parametrize("name", SETTINGS)
def test_left_padded_batch_continues_each_prompt_as_alone(name):
    """Prompts of 7, 2 and 5 tokens (left-padded by 0, 5 and 2, not multiples of the window of 4)."""
    model = native(**SETTINGS[name])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = wrapped(model).generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
    alone = [generate(model, p, 15, temperature=0)[0] for p in prompts]
    assert out[:, width:].tolist() == alone


def native_greedy(model, prompt, new_tokens):
    """Greedy continuation by recomputing the whole sequence each token: no cache involved."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", ["lavo", "softmax-rope"])
def test_generate_continues_from_a_returned_state_given_the_whole_sequence(name):
    """transformers' way to reuse a state: the whole sequence so far with the state; the consumed positions must
    be cut off, not fed twice."""
    model = native(50, **SETTINGS[name])  # a vocabulary on which feeding the context twice changes the tokens
    hub = wrapped(model)
    first = hub.generate(torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), max_new_tokens=5, do_sample=False,
                         eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    extended = torch.cat([first.sequences, torch.tensor([[3, 4, 5]])], 1)
    out = hub.generate(extended, cache=first.cache, max_new_tokens=6, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    expected = native_greedy(model, extended[0].tolist(), 6)
    assert len(set(expected)) > 2 and out[0, extended.shape[1]:].tolist() == expected


def test_a_state_passed_to_a_beam_search_is_repeated_as_the_message_says():
    """generate() repeats the prompt for each beam but not a state passed with it."""
    hub, prompt = wrapped(native(50)), torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        state = hub(prompt[:, :4]).cache
    options = dict(max_new_tokens=4, num_beams=2, eos_token_id=None, pad_token_id=0)
    with pytest.raises(ValueError, match=r"^the state holds 1 rows, got input of batch size 2: generate\(\) repeats "
                       r"each prompt 2 times \(num_beams, num_return_sequences\) but not a state passed to it; call "
                       r"state\.batch_repeat_interleave\(2\) first$"):
        hub.generate(prompt, cache=copy.deepcopy(state), **options)
    state.batch_repeat_interleave(2)
    assert hub.generate(prompt, cache=state, **options).tolist() == hub.generate(prompt, **options).tolist()


def test_past_key_values_is_another_name_for_the_state():
    model = native()
    hub = wrapped(model)
    ids = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        expected, _ = model(ids)
        state = hub(ids[:, :6]).cache
        continued = hub(ids[:, 6:], past_key_values=state).logits
        torch.testing.assert_close(continued, expected[:, 6:], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="pass the state as cache or as past_key_values, not both"):
            hub(ids[:, 6:], cache=state, past_key_values=state)


def test_an_empty_transformers_cache_starts_a_state_and_one_holding_positions_is_refused():
    """transformers' guides pass a new DynamicCache to generate(): it starts a state like no cache at all."""
    from transformers import DynamicCache
    model = native(50)
    hub, prompt = wrapped(model), [5, 6, 7, 8, 9, 10, 11]
    assert hub_generate(hub, prompt, 6, do_sample=False, past_key_values=DynamicCache(config=hub.config)) == \
        native_greedy(model, prompt, 6)
    holding = DynamicCache()
    holding.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), layer_idx=0)
    for cache, kind in ((holding, "DynamicCache holding positions"), ((), "tuple")):
        with pytest.raises(TypeError, match=f"^LavoLMForCausalLM continues a lavo.hf.LavoState \\(the cache its calls "
                                            f"return\\), got a {kind}: pass no cache to start, or the one a call "
                                            "returned$"):
            hub(torch.tensor([prompt]), past_key_values=cache)


def test_no_new_positions_are_refused_by_name():
    """A state reused with only the new ids (generate() wants the whole sequence), or an empty prompt."""
    hub = wrapped(native())
    state = hub(torch.tensor([[5, 6, 7, 8]])).cache
    message = (r"^input_ids has no positions; generate\(\) takes the whole sequence so far \(the positions a state "
               r"passed with it has consumed, then the new ones\), a call of the model only the new ones$")
    for call in (lambda: hub.generate(torch.tensor([[9, 10]]), cache=state, max_new_tokens=2, pad_token_id=0),
                 lambda: hub(torch.zeros(1, 0, dtype=torch.long))):
        with pytest.raises(ValueError, match=message):
            call()


def test_untied_output_embeddings_are_refused(saved):
    """In the config, and from from_pretrained's keyword arguments, which transformers sets after the config is
    made."""
    message = "^LavoLMForCausalLM reads its logits from the token embedding matrix: tie_word_embeddings=False is " \
              "not supported$"
    for make in (lambda: H.LavoLMConfig(tie_word_embeddings=False),
                 lambda: AutoModelForCausalLM.from_pretrained(saved[0], tie_word_embeddings=False)):
        with pytest.raises(ValueError, match=message):
            make()


def test_a_mechanism_with_a_non_persistent_buffer_is_refused_before_it_saves_or_loads_garbage():
    """from_pretrained builds the model on the meta device and gives non-persistent buffers uninitialised memory,
    which the wrapper cannot refill: the logits would silently differ."""
    from lavo import Mechanism, register_attention
    from lavo.registry import ATTENTIONS

    @register_attention("test-buffered")
    class Buffered(Mechanism):
        def __init__(self, dim, heads, *, causal=True):
            super().__init__(dim, heads, causal=causal)
            self.register_buffer("gain", torch.full((dim,), 0.5), persistent=False)

        def forward(self, x, padding_mask=None, cache=None):
            return x * self.gain, None

    try:
        model = native(attention="test-buffered", attention_options={})
        with pytest.raises(ValueError, match=r"^the Hugging Face model saves and restores persistent buffers only; "
                           r"not persistent: blocks\.0\.attention\.gain, blocks\.1\.attention\.gain "
                           r"\(from_pretrained would leave uninitialised memory there\): register them with "
                           r"persistent=True$"):
            H.LavoLMForCausalLM.from_native(model)
    finally:
        ATTENTIONS.pop("test-buffered")


@pytest.mark.parametrize("options, message", [
    (dict(inputs_embeds=torch.zeros(1, 3, 32)), "LavoLMForCausalLM takes input_ids only, not inputs_embeds"),
    (dict(output_hidden_states=True), "does not return hidden states: call it without output_hidden_states=True"),
    (dict(output_attentions=True), "does not return attention weights: call it without output_attentions=True"),
])
def test_what_the_model_cannot_return_is_refused(options, message):
    ids = None if "inputs_embeds" in options else torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=message):
        wrapped(native())(ids, **options)


@pytest.mark.parametrize("flag, what", [("output_hidden_states", "hidden states"),
                                        ("output_attentions", "attention weights")])
def test_what_the_config_asks_the_model_to_return_and_it_cannot_is_refused(flag, what, saved):
    with pytest.raises(ValueError, match=f"^LavoLMForCausalLM does not return {what}: {flag}=True is not supported$"):
        AutoModelForCausalLM.from_pretrained(saved[0], **{flag: True})
    hub, ids = wrapped(native()), torch.tensor([[1, 2, 3]])
    setattr(hub.config, flag, True)
    with pytest.raises(ValueError, match=f"^LavoLMForCausalLM does not return {what}: set model.config.{flag} = "
                       "False$"):
        hub(ids)
    assert hub(ids, **{flag: False}).logits.shape == (1, 3, 61)  # the call's choice before the config's


def test_use_cache_on_a_mechanism_without_decoding_recomputes_instead_of_feeding_one_token():
    model = native(50, attention="longshort", attention_options={})
    prompt = [5, 6, 7, 8, 9, 10, 11]
    out = hub_generate(wrapped(model), prompt, 6, do_sample=False, use_cache=True)
    expected = native_greedy(model, prompt, 6)
    assert len(set(expected)) > 2 and out == expected


def test_resized_embeddings_score_a_padded_batch():
    hub = wrapped(native())
    hub.resize_token_embeddings(70)
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    with torch.no_grad():
        padded = hub(ids, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]])).logits
        alone = hub(ids[:1, 1:]).logits
    assert padded.shape == (2, 3, 70)
    torch.testing.assert_close(padded[:1, 1:], alone, rtol=0, atol=1e-5)


def test_a_padded_batch_under_autocast_returns_logits_of_the_autocast_dtype():
    """As an unpadded batch does; they were float32, an extra [B, T, vocab] copy."""
    hub = wrapped(native())
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        padded = hub(ids, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]])).logits
        unpadded = hub(ids).logits
    assert padded.dtype == unpadded.dtype == torch.bfloat16


def test_a_loss_over_num_items_in_batch_is_the_summed_loss_over_that_count():
    """Trainer passes the token count of a whole accumulated batch; the loss must divide by it, not average."""
    hub = wrapped(native())
    ids = torch.randint(0, 61, (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100  # 3 of the 16 shifted labels ignored
    with torch.no_grad():
        mean = hub(ids, labels=labels).loss
        over_count = hub(ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    torch.testing.assert_close(over_count, mean * 13 / 40)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_changes_no_rows_loss(side):
    """The loss of a padded batch is the loss of its rows alone: a padded position's zero logits once 'predicted'
    the first real token of a left-padded row, at log(vocab) each."""
    hub = wrapped(native())
    rows = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5, 7)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        columns = slice(9 - len(row), 9) if side == "left" else slice(0, len(row))
        ids[i, columns], mask[i, columns] = row, 1
    with torch.no_grad():
        batch = hub(ids, attention_mask=mask, labels=ids).loss
        alone = sum(hub(row[None], labels=row[None], num_items_in_batch=1).loss for row in rows) / (8 + 4 + 6)
    torch.testing.assert_close(batch, alone)


def trainer_count(labels):
    """num_items_in_batch as Trainer counts it for a causal language model: the labels after the first column
    that are not -100."""
    return int((labels[:, 1:] != -100).sum())


def test_labels_trainer_counts_but_the_loss_ignores_are_refused(tokenizer):
    """Trainer divides the summed loss by its own count of labels, which takes the first real token of a
    left-padded row (the tokenizer pads on the left) for a target: the loss, which ignores it, came out too small
    by that share."""
    hub = wrapped(native(tokenizer.vocab_size), pad_token_id=tokenizer.eot_id)
    collate = transformers.DataCollatorForLanguageModeling(H.hub_tokenizer(tokenizer), mlm=False)
    batch = collate([{"input_ids": tokenizer.encode(text)} for text in ("the sister said", "said the brother")])
    message = (r"rows \[0\] have labels other than -100 at or just after padding, which the loss ignores \(padding "
               r"predicts nothing\) but num_items_in_batch counts as Trainer does: pad on the right with labels -100 "
               r"at padding \(lavo.hf.LanguageModelingCollator does\), or set those labels to -100")
    with pytest.raises(ValueError, match=message):
        hub(**batch, num_items_in_batch=trainer_count(batch["labels"]))


def test_the_collator_pads_features_the_tokenizer_padded_on_the_right_and_trainer_counts_their_targets(tokenizer):
    """Features the left-padding tokenizer padded once had their padding fed and trained on as end-of-text
    tokens; the collator keeps their real tokens, and Trainer's count of its labels is that of the rows' targets."""
    texts = ["the sister said", "said the brother to his sister", "said"]
    hub = wrapped(native(tokenizer.vocab_size), pad_token_id=tokenizer.eot_id)
    rows = [torch.tensor([tokenizer.encode(text)]) for text in texts]
    tokenized = H.hub_tokenizer(tokenizer)(texts, padding=True)
    batch = H.LanguageModelingCollator(tokenizer.eot_id)([dict(zip(tokenized, values))
                                                          for values in zip(*tokenized.values())])
    assert batch["input_ids"][:, 0].tolist() == [int(row[0, 0]) for row in rows]  # no padding fed first
    with torch.no_grad():
        targets = sum(row.shape[1] - 1 for row in rows)
        alone = sum(hub(row, labels=row, num_items_in_batch=1).loss for row in rows) / targets
        loss = hub(**batch, num_items_in_batch=trainer_count(batch["labels"])).loss
    torch.testing.assert_close(loss, alone)


def test_the_collator_refuses_a_mask_of_another_length_than_the_ids():
    with pytest.raises(ValueError, match=r"^a feature's attention_mask has 2 entries for its 3 input_ids: give one "
                                         r"entry per id$"):
        H.LanguageModelingCollator(0)([{"input_ids": [5, 6, 7], "attention_mask": [1, 1]}])


def test_a_bfloat16_native_model_wraps_as_bfloat16():
    model = native().to(torch.bfloat16)
    hub = wrapped(model)
    assert {p.dtype for p in hub.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 61, (1, 8))
    with torch.no_grad():
        assert torch.equal(hub(ids).logits, model(ids)[0])


def test_padding_inside_a_row_is_refused():
    model = wrapped(native())
    with pytest.raises(ValueError, match=r"rows \[1\] have padding between real tokens"):
        model(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]]))


def test_the_lavo_state_stays_the_same_size_however_long_the_generation():
    """Within a window the local branch keeps w to 2w - 1 keys, so the size is compared at the same place in
    the window: 15, 43 and 83 tokens consumed (the last generated token is never fed)."""
    def state_bytes(model, new_tokens):
        out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
        assert out.sequences.shape[1] == 3 + new_tokens
        assert isinstance(out.cache, H.LavoState)
        return out.cache.nbytes()

    lavo = wrapped(native())
    sizes = [state_bytes(lavo, n) for n in (13, 41, 81)]
    # 2 layers, B=1, H=2, D=16, rank 16, window 4
    assert sizes[0] == sizes[1] == sizes[2] == 2 * LavoCache.max_nbytes(1, 2, 16, 16, 4)
    softmax = wrapped(native(**SETTINGS["softmax-rope"]))
    assert state_bytes(softmax, 40) < state_bytes(softmax, 80)  # the key/value cache grows with the context


def test_save_then_load_in_a_fresh_process_gives_the_same_logits(saved):
    directory, model = saved
    assert (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file()
    ids = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    script = ("import json, sys, torch, lavo.hf\n"
              "from transformers import AutoModelForCausalLM\n"
              "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
              "print(json.dumps(model(torch.tensor(json.loads(sys.argv[2]))).logits.tolist()))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script, str(directory), json.dumps(ids)], capture_output=True,
                            text=True, env=env, check=True)
    with torch.no_grad():
        expected, _ = model(torch.tensor(ids))
    torch.testing.assert_close(torch.tensor(json.loads(result.stdout)), expected, rtol=0, atol=1e-5)


def test_pipeline_generates_text_offline_from_the_directory(saved, tokenizer):
    directory, model = saved
    generator = pipeline("text-generation", model=str(directory))
    assert isinstance(generator.model, H.LavoLMForCausalLM)
    prompt = "the sister said"
    text = generator(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    expected = generate(model, tokenizer.encode(prompt), 8, temperature=0, stop_id=tokenizer.eot_id)[0]
    assert text == prompt + tokenizer.decode(expected) and len(text) > len(prompt)
    batched = generator([prompt, "mr"], max_new_tokens=8, do_sample=False, batch_size=2)
    assert batched[0][0]["generated_text"] == text


def test_the_tokenizer_round_trips_and_a_missing_file_is_an_error(saved, tokenizer, tmp_path):
    directory, _ = saved
    loaded = AutoTokenizer.from_pretrained(directory)
    assert isinstance(loaded, H.LavoTokenizer)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config.pop("split_special_tokens") is True
    older = tmp_path / "older"  # an export from before the setting was written down
    shutil.copytree(directory, older)
    (older / "tokenizer_config.json").write_text(json.dumps(config))
    for text in ("miss emma walked to the garden", f"the sister{EOT}the mother"):  # the token's text stays text
        for hub in (loaded, AutoTokenizer.from_pretrained(older)):
            ids = hub(text)["input_ids"]
            assert ids == tokenizer.encode(text) and hub.decode(ids) == text
    assert loaded.eos_token_id == loaded.pad_token_id == tokenizer.eot_id and loaded.padding_side == "left"
    (directory / "tokenizer.json").rename(directory / "moved.json")
    try:
        with pytest.raises(ValueError, match="has no tokenizer.json: a LAVO model's tokenizer is that file"):
            AutoTokenizer.from_pretrained(directory)
        with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
            H.load_exported(directory)
    finally:
        (directory / "moved.json").rename(directory / "tokenizer.json")


def test_an_export_missing_weights_or_holding_others_is_refused_by_name(saved, tmp_path):
    """transformers loads a missing weight as the memory it allocated (NaN, say), and `lavo eval` scored it; for
    one of another shape it raised an error that pointed to a report in its log."""
    from safetensors.torch import load_file, save_file
    directory, _ = saved
    weights = load_file(str(directory / "model.safetensors"))
    for name, change in (("missing", lambda w: w.pop("lavo.blocks.0.mlp.0.weight")),
                         ("unexpected", lambda w: w.__setitem__("lavo.extra", torch.zeros(2))),
                         ("resized", lambda w: w.__setitem__("lavo.blocks.0.mlp.0.weight", torch.zeros(3, 32)))):
        damaged = tmp_path / name
        shutil.copytree(directory, damaged)
        edited = dict(weights)
        change(edited)
        save_file(edited, str(damaged / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(RunError, match=re.escape(f"{damaged} does not hold the weights of the model its "
                                                     "config.json describes (lavo, dim 32, depth 2): ") + name):
            H.load_exported(damaged)


@pytest.mark.parametrize("changed", [dict(depth=3), dict(vocab_size=70, ignore_mismatched_sizes=True)])
def test_weights_from_pretrained_finds_none_for_are_drawn_as_the_native_model_draws_them(changed, tmp_path):
    """A deeper model, or another vocabulary, from a checkpoint: transformers left the weights it found none for
    as the memory it allocated (NaN logits), and reported them newly initialised."""
    from lavo.model import LanguageModel
    model = native(attention_options={"window": 4, "basis": "learned", "rank": 8})
    wrapped(model).save_pretrained(tmp_path)
    torch.manual_seed(5)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, **changed).eval()
    torch.manual_seed(5)
    fresh = LanguageModel(loaded.lavo.config).state_dict()
    saved = model.state_dict()
    for name, tensor in loaded.lavo.state_dict().items():
        kept = name in saved and saved[name].shape == tensor.shape
        assert torch.equal(tensor, saved[name] if kept else fresh[name]), name
    with torch.no_grad():
        assert loaded(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_input_ids_of_another_shape_or_outside_the_vocabulary_are_refused_by_name():
    model = wrapped(native())
    with pytest.raises(ValueError, match=re.escape("input_ids must have shape [B, T], got (3,)")):
        model(torch.tensor([1, 2, 3]))
    for call in (lambda ids: model(ids), lambda ids: model.generate(ids, max_new_tokens=2, pad_token_id=0)):
        with pytest.raises(ValueError, match=re.escape("input_ids hold ids outside the model's vocabulary of 61: "
                                                       "[-1, 99]")):
            call(torch.tensor([[1, 99, -1]]))


@pytest.mark.parametrize("options, message", [
    (dict(attention_mask=torch.ones(3, dtype=torch.long)),
     "attention_mask must have shape [B, positions] with the 1 rows of input_ids, got (3,)"),
    (dict(attention_mask=torch.ones(2, 3, dtype=torch.long)),
     "attention_mask must have shape [B, positions] with the 1 rows of input_ids, got (2, 3)"),
    (dict(labels=torch.tensor([[1, 2]])), "labels must have the shape of input_ids, (1, 3), got (1, 2)"),
])
def test_a_mask_or_labels_of_another_shape_are_refused_by_name(options, message):
    """Once an IndexError (a mask of one dimension) and a broadcasting error from the loss (labels)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        wrapped(native())(torch.tensor([[1, 2, 3]]), **options)


def test_sequences_packed_into_one_row_are_refused():
    """DataCollatorWithFlattening packs sequences into one row and restarts position_ids at each: the model,
    which counts positions itself, once attended across them, silently."""
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    message = ("position_ids restart or skip within a row, as for sequences packed into one row: the model counts "
               "positions itself and would attend across them; pad the sequences instead "
               "(lavo.hf.LanguageModelingCollator)")
    with pytest.raises(ValueError, match=re.escape(message)):
        wrapped(native())(**batch)


def test_the_command_line_keeps_the_hub_offline_unless_told_otherwise():
    script = "import lavo.cli\nfrom huggingface_hub import constants\nprint(constants.HF_HUB_OFFLINE)\n"
    environment = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    for setting, expected in ((None, "True"), ("0", "False")):
        env = {**environment, "PYTHONPATH": str(ROOT), **({"HF_HUB_OFFLINE": setting} if setting else {})}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
        assert result.stdout.strip() == expected


def test_lavo_does_not_import_transformers():
    script = ("import sys, lavo, lavo.model, lavo.cli, lavo.run, lavo.evaluate, lavo.generate\n"
              "lavo.cli.build_parser()\n"
              "print('transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout.strip() == "False"


def test_a_transformers_that_fails_to_import_is_not_reported_as_missing(tmp_path):
    """A transformers whose own import fails (a dependency missing) was reported as not installed, with advice to
    install it; its error was left out of lavo eval's one line."""
    (tmp_path / "broken" / "transformers").mkdir(parents=True)
    (tmp_path / "broken" / "transformers" / "__init__.py").write_text(
        "raise ImportError('transformers needs accelerate>=1.1.0', name='accelerate')\n")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"model_type": "lavo_lm"}')
    script = ("import sys\n"
              "from lavo.run import load_model_dir\n"
              "for where in ('missing', 'broken'):\n"
              "    if where == 'missing':\n"
              "        sys.modules['transformers'] = None\n"
              "    else:\n"
              "        del sys.modules['transformers']\n"
              "        sys.path.insert(0, sys.argv[1])\n"
              "    for call in (lambda: __import__('lavo.hf'), lambda: load_model_dir(sys.argv[2])):\n"
              "        try:\n"
              "            call()\n"
              "        except (ImportError, ValueError) as error:\n"
              "            print(error)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "broken"), str(tmp_path / "export")],
                            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    export = tmp_path / "export"
    assert result.stdout.splitlines() == [
        "lavo.hf needs transformers: install the extra with `pip install -e '.[hf]'`",
        f"{export} is a Hugging Face model directory: reading it needs transformers (`pip install -e '.[hf]'`)",
        "transformers needs accelerate>=1.1.0",
        f"{export} is a Hugging Face model directory: reading it needs transformers, which failed to import: "
        "transformers needs accelerate>=1.1.0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny trained run and its export."""
    from lavo.cli import main
    from lavo.config import RunConfig
    from lavo.train import train
    from lm_corpus import tiny_run, write_corpus
    root = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(root / "corpus", documents=4, words=1500)
    train(RunConfig.from_dict(tiny_run(corpus, root / "data", root / "run", steps=3)), log=lambda *_: None)
    assert main(["export", str(root / "run"), str(root / "exported")]) == 0
    return root


def test_export_refuses_its_own_run_folder_an_exported_folder_and_a_file(trained, tmp_path, capsys):
    from lavo.cli import main
    run, exported = str(trained / "run"), str(trained / "exported")
    assert main(["export", run, run, "--overwrite"]) == 2
    assert "is the run directory itself: exporting there would replace the run's config.json and weights" in (
        capsys.readouterr().err)
    assert (trained / "run" / "state.pt").is_file() and not (trained / "run" / "generation_config.json").exists()
    assert main(["export", exported, str(trained / "again")]) == 2
    assert "is already an exported model directory: copy it, or export the run it came from" in (
        capsys.readouterr().err)
    assert main(["export", str(tmp_path / "no-run"), str(tmp_path / "out" / "deep")]) == 2
    assert "no-run is not a directory" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "notes.txt").write_text("")
    for target in ("notes.txt", "notes.txt/model"):
        assert main(["export", run, str(tmp_path / target)]) == 2
        assert (f"error: the export directory {tmp_path / target} cannot be a directory: {tmp_path / 'notes.txt'} is "
                "a file") in capsys.readouterr().err


def test_export_writes_a_directory_pipelines_and_the_cli_read(trained, tmp_path, capsys):
    from lavo.cli import main
    from lavo.run import is_exported, load_run
    run, exported = trained / "run", trained / "exported"
    assert is_exported(exported) and not is_exported(run)
    written = sorted(p.name for p in exported.iterdir())
    assert written == ["config.json", "documents.json", "generation_config.json", "model.safetensors",
                       "tokenizer.json", "tokenizer_config.json"]
    # and the README lists them all (was: not generation_config.json nor tokenizer_config.json)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listing = re.search(r"becomes a Hugging Face model directory \((.*?)\):", readme, re.DOTALL).group(1)
    assert sorted(re.findall(r"`([\w.]+)`", listing)) == written
    # every file as open() makes it (safetensors alone makes its files 0600: unreadable to a group sharing models)
    (tmp_path / "probe").write_text("")
    assert {path.stat().st_mode for path in exported.iterdir()} == {(tmp_path / "probe").stat().st_mode}
    model, config, tokenizer = load_run(run)
    hub = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert hub.config.lavo_run["data"]["holdout"] == ["doc3"] and hub.generation_config.eos_token_id == 0
    ids = torch.tensor([tokenizer.encode("the sister said to her mother")])
    with torch.no_grad():
        torch.testing.assert_close(hub(ids).logits, model(ids)[0], rtol=0, atol=1e-5)

    capsys.readouterr()
    args = ["--prompt", "the sister", "--max-new-tokens", "12", "--seed", "3"]
    assert main(["generate", str(run), *args]) == 0
    from_run = capsys.readouterr().out
    assert main(["generate", str(exported), *args]) == 0
    assert capsys.readouterr().out == from_run
    evaluate = ["--lengths", "32,64", "--chunk-size", "24", "--quiet"]
    assert main(["eval", str(run), *evaluate, "--out", str(trained / "eval-run")]) == 0
    assert main(["eval", str(exported), *evaluate, "--out", str(trained / "eval-exported")]) == 0
    results = [json.loads((trained / name / "results.json").read_text())["results"]
               for name in ("eval-run", "eval-exported")]
    assert results[0]["run"] == results[1]["exported"]

    assert main(["export", str(run), str(exported)]) == 2
    assert "is not empty: choose another directory or pass --overwrite" in capsys.readouterr().err
    old_run, again = tmp_path / "old-run", tmp_path / "again"  # a run from before runs recorded their documents
    shutil.copytree(run, old_run)
    (old_run / "documents.json").unlink()
    shutil.copytree(exported, again)
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):  # as a sharded save leaves
        (again / stale).write_text("{}")
    assert main(["export", str(old_run), str(again), "--overwrite"]) == 0
    assert not (again / "documents.json").exists()  # not the overwritten export's, which eval would check against
    assert sorted(p.name for p in again.glob("*.safetensors*")) == ["model.safetensors"]


def test_an_export_without_its_run_config_needs_a_text_and_lengths(trained, tmp_path, capsys):
    from lavo.cli import main
    config = json.loads((trained / "exported" / "config.json").read_text())
    config["lavo_run"] = None
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((trained / "exported" / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["eval", str(tmp_path), "--quiet"]) == 2
    assert "do not record the data they trained on: score a text with --text FILE" in capsys.readouterr().err
    text = ["--text", str(trained / "corpus" / "doc3.txt"), "--quiet"]
    assert main(["eval", str(tmp_path), *text]) == 2
    assert "do not record their training length: give --lengths" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), *text, "--lengths", "32"]) == 0
    assert "tokens of" in capsys.readouterr().out


def test_the_cli_loads_an_export_without_progress_bars_and_leaves_them_as_they_were(trained, capsys):
    from transformers.utils import logging as hf_logging
    capsys.readouterr()
    for enabled in (True, False):
        (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
        H.load_exported(trained / "exported")
        assert "Loading weights" not in capsys.readouterr().err and hf_logging.is_progress_bar_enabled() == enabled
    hf_logging.enable_progress_bar()


def test_the_stream_example_names_a_run_directory_and_a_missing_text(trained, tmp_path, capsys, monkeypatch):
    """Also (was: a traceback, or nothing printed and status 0) an empty or Latin-1 text and a missing GPU."""
    from script_loader import load_script
    example = load_script("stream_perplexity", "examples/stream_perplexity.py")
    run, exported, text = trained / "run", trained / "exported", trained / "corpus" / "doc3.txt"
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')  # another model's folder, not a run
    no_state = tmp_path / "longshort"
    wrapped(native(attention="longshort", attention_options={"window": 4})).save_pretrained(no_state)
    empty, latin1 = tmp_path / "empty.txt", tmp_path / "latin1.txt"
    empty.write_text("")
    latin1.write_bytes("the sister said caf\u00e9 au lait".encode("latin-1"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in [((run, text), f"{run} is a training run: export it first (`lavo export {run} OUT_DIR`)"),
                          ((tmp_path, text), f"{tmp_path} is not a directory written by `lavo export`"),
                          ((exported, tmp_path / "missing.txt"), f"{tmp_path / 'missing.txt'} is not a file"),
                          ((exported, text, "--chunk-tokens", "0"), "must be an integer >= 1; got '0'"),
                          ((no_state, text), "is a longshort model, which has no decoding form, so no state"),
                          ((exported, empty), f"{empty} holds fewer than two tokens: nothing to score"),
                          ((exported, latin1), f"{latin1} is not UTF-8 text (invalid continuation byte): convert it"),
                          ((exported, text, "--device", "cuda"), "no CUDA device is available: choose the CPU")]:
        with pytest.raises(SystemExit) as stopped:
            example.main([str(path) for path in argv])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_stream_example_scores_a_long_text_with_a_constant_state(saved, tokenizer, tmp_path):
    """examples/stream_perplexity.py: the same tokens and perplexity as one pass over the whole text."""
    from script_loader import load_script
    example = load_script("stream_perplexity", "examples/stream_perplexity.py")
    directory, model = saved
    words = (WORDS * 40)[::7]
    text = tmp_path / "long.txt"
    text.write_text(" ".join(words[i] + ("\n\n" if i % 50 == 49 else "") for i in range(len(words))))
    reports = list(example.running_perplexity(AutoModelForCausalLM.from_pretrained(directory).eval(),
                                              AutoTokenizer.from_pretrained(directory), str(text),
                                              chunk_tokens=64, block_chars=300))
    tokens = tokenizer.encode(text.read_text())
    assert len(reports) > 5 and reports[-1]["tokens"] == len(tokens) - 1
    assert len({r["state_bytes"] for r in reports[:-1]}) == 1  # chunks of 64: the same place in every window
    with torch.no_grad():
        logits, _ = model(torch.tensor([tokens[:-1]]))
    nll = torch.nn.functional.cross_entropy(logits[0], torch.tensor(tokens[1:]))
    assert reports[-1]["ppl"] == pytest.approx(nll.exp().item(), rel=1e-4)


def test_the_stream_example_reads_a_text_without_its_byte_order_mark(tokenizer, tmp_path):
    """As lavo eval --text reads it (was: the mark, U+FEFF, was the first token's text)."""
    from script_loader import load_script
    example = load_script("stream_perplexity", "examples/stream_perplexity.py")
    marked = tmp_path / "marked.txt"
    marked.write_text("the sister said to her mother", encoding="utf-8-sig")
    tokens = tokenizer.encode("the sister said to her mother")
    assert list(example.token_chunks(str(marked), H.hub_tokenizer(tokenizer), 64, 300)) == [tokens]


def test_from_native_keeps_the_models_mode():
    """A wrapper in training mode would drop tokens out in generate(): two greedy calls differed."""
    model = native(dropout=0.2)
    assert not wrapped(model).training and wrapped(model.train()).training


def test_generate_refuses_a_row_without_a_real_token():
    model = wrapped(native())
    ids = torch.tensor([[0, 0, 0], [5, 6, 7]])
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match=r"rows \[0\] of attention_mask have no real token"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)


def test_an_export_saved_in_bfloat16_loads_as_float32_for_scoring(tokenizer, tmp_path):
    """lavo eval records --dtype float32: the model it scores must compute in float32, whatever dtype was saved."""
    model = native(tokenizer.vocab_size)
    wrapped(model.to(torch.bfloat16)).save_pretrained(tmp_path)
    H.hub_tokenizer(tokenizer).save_pretrained(tmp_path)
    loaded, _, _ = H.load_exported(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    ids = torch.tensor([tokenizer.encode("the sister said")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids)[0], model.float()(ids)[0], rtol=0, atol=0)


def test_trainer_helpers_batch_optimise_and_step_as_lavo_train_does():
    """Trainer's collator ignores every end-of-text label (the pad token), its AdamW decays S4D's system and
    ignores its learning-rate cap, and it never tells Performer of an optimizer step: the helpers do as lavo
    train does."""
    from transformers import TrainerControl, TrainerState

    batch = H.LanguageModelingCollator(pad_id=0, pad_to_multiple_of=4)([{"input_ids": [5, 0, 7]},
                                                                         {"input_ids": [9, 8, 7, 6, 0]}])
    assert batch["input_ids"].tolist() == [[5, 0, 7, 0, 0, 0, 0, 0], [9, 8, 7, 6, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 0, 7, -100, -100, -100, -100, -100], [9, 8, 7, 6, 0, -100, -100, -100]]

    s4d = wrapped(native(attention="s4d", attention_options={}))
    optimizer = H.lavo_optimizer(s4d, lr=3e-3, weight_decay=0.1)
    system = {id(p) for block in s4d.lavo.blocks for p in block.attention.system_parameters()}
    for group in optimizer.param_groups:
        if any(id(p) in system for p in group["params"]):
            assert group["weight_decay"] == 0 and group["lr"] == 1e-3
    assert any(group["weight_decay"] == 0.1 for group in optimizer.param_groups)

    performer = wrapped(native(attention="performer", attention_options={"redraw_interval": 1}))
    before = performer.lavo.blocks[0].attention.projection.clone()
    H.MechanismCallback().on_optimizer_step(None, TrainerState(), TrainerControl(), model=performer)
    assert not torch.equal(performer.lavo.blocks[0].attention.projection, before)


def test_resizing_the_embeddings_resizes_the_native_model_too():
    hub = wrapped(native())
    hub.resize_token_embeddings(64)
    assert hub.lavo.config.vocab_size == 64 == hub.config.vocab_size
    assert len(generate(hub.lavo, [62, 63], 3, temperature=0)[0]) == 3
    assert H.LavoLMForCausalLM.from_native(hub.lavo).lavo.embed.num_embeddings == 64


def test_embeddings_resized_without_mean_resizing_are_drawn_at_the_models_scale():
    """transformers asks the model to draw the new rows; torch's Normal(0, 1) gave the new tokens' tied logits
    1 / init_std times the others' scale."""
    hub = wrapped(native())  # init_std 0.3
    before = hub.lavo.embed.weight.detach().clone()
    torch.manual_seed(2)
    weight = hub.resize_token_embeddings(400, mean_resizing=False).weight.detach()
    assert torch.equal(weight[:61], before)
    assert weight[61:].std().item() == pytest.approx(0.3, rel=0.05)


@pytest.mark.parametrize("name", available_attentions())
def test_a_right_padded_batch_without_a_state_is_one_native_call_with_the_rows_logits(name):
    """Training needs no state: a right-padded batch then runs once, not once per row length, and each row's
    logits are those of the row alone."""
    from reference_checks import forward_calls
    hub = wrapped(native(attention=name, attention_options={}))
    rows = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 7)]
    ids = torch.full((3, 9), 1000)  # a pad id outside the vocabulary: never embedded
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    calls = forward_calls([hub.lavo])
    with torch.no_grad():
        out = hub(ids, attention_mask=mask, use_cache=False)
        assert calls == [1] and out.cache is None
        for i, row in enumerate(rows):
            torch.testing.assert_close(out.logits[i, :len(row)], hub(row[None]).logits[0], atol=1e-5, rtol=1e-5)
        assert torch.all(out.logits[mask == 0] == 0)


def test_generate_refuses_more_positions_than_a_layer_reads_before_it_starts():
    hub = wrapped(native(attention="cosformer", attention_options={"max_length": 12}))
    prompt = torch.tensor([[5, 6, 7]])
    assert hub.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0).shape == (1, 13)
    message = (r"this model reads at most 12 positions \(its CosformerAttention with max_positions=12\): after a "
               r"3-token prompt it can generate at most 10 tokens, not 11")
    with pytest.raises(ValueError, match=message):
        hub.generate(prompt, max_new_tokens=11, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match=message):
        hub.generate(input_ids=prompt, max_length=14, do_sample=False, pad_token_id=0)


def test_generate_without_a_length_continues_by_transformers_default_of_20_tokens():
    """The plainest call, generate(ids): the room check once failed on the unset max_length with a TypeError."""
    hub = wrapped(native())
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.warns(UserWarning, match="model-agnostic default `max_length`"):  # transformers' own
        unset = hub.generate(prompt, pad_token_id=0, eos_token_id=None)
    assert torch.equal(unset, hub.generate(prompt, max_new_tokens=20, pad_token_id=0, eos_token_id=None))
    bounded = wrapped(native(attention="cosformer", attention_options={"max_length": 12}))
    with pytest.raises(ValueError, match="after a 3-token prompt it can generate at most 10 tokens, not 20"):
        bounded.generate(prompt, pad_token_id=0)
