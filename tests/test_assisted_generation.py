"""Assisted generation (speculative decoding) over TQCache on the CPU: the target model verifies draft
tokens in one multi-token forward and ``crop`` rolls the rejected ones back."""

import pytest
import torch

pytest.importorskip("transformers")

from flash_attn_tq.integrations.transformers import TQCache, TQLayer  # noqa: E402
from flash_attn_tq.testing import speculative  # noqa: E402
from flash_attn_tq.testing.assets import TINY_LLAMA, random_llama  # noqa: E402

# weights larger than the default init, so that greedy decoding does not settle on one token
CONFIG = dict(TINY_LLAMA, num_attention_heads=8, num_key_value_heads=4, head_dim=32, initializer_range=0.2)
NEW = 200


@pytest.fixture(scope="module")
def model():
    return random_llama(CONFIG, dtype=torch.float64, attn_implementation="tq_kvcache")


def _prompt():
    span = torch.randint(0, CONFIG["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(1))
    return torch.cat([span] * 3, 1)  # repeats, so that prompt lookup finds drafts


def _generate(model, cache, **kwargs):
    ids = _prompt()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)
    return out[0, ids.shape[1] :].tolist()


def test_assisted_generation_is_exact_where_every_token_is_in_codes(model, monkeypatch):
    """Without a 16-bit window or a key center (fit on the first forward, which assisted generation
    runs over the prompt and its first drafts), a token's codes do not depend on how the tokens were
    batched: greedy assisted decoding gives greedy decoding's tokens through many rollbacks."""
    options = dict(fp16_window=0, key_center=False)
    removed = []
    crop = TQLayer.crop

    def counting_crop(self, tokens_to_remove):
        removed.append(int(tokens_to_remove))
        return crop(self, tokens_to_remove)

    plain = _generate(model, TQCache(model.config, **options))
    monkeypatch.setattr(TQLayer, "crop", counting_crop)
    assisted = _generate(model, TQCache(model.config, **options), prompt_lookup_num_tokens=8)
    assert len(set(plain)) > 50
    assert assisted == plain
    assert sum(r < 0 for r in removed) >= 20 * CONFIG["num_hidden_layers"]  # rejected drafts rolled back


def test_speculative_decoding_over_the_default_cache_is_exact(model):
    """The default cache (sinks, a 16-bit window, the RoPE key center): each query of a verify call sees
    its own 16-bit window, as a one-token decode at its position would (the side keeps verify_tokens
    - 1 slots past the window), and a rollback leaves every slot of the window as it was. Decoding
    as a serving engine speculates (the prompt written first, then prompt-lookup drafts verified and
    rolled back) gives greedy decoding's tokens, well past the window's length."""
    ids = _prompt()
    plain = speculative.generate(model, ids, TQCache(model.config), NEW, draft_tokens=0)
    spec = speculative.generate(model, ids, TQCache(model.config), NEW, draft_tokens=8)
    assert len(set(plain.tokens)) > 50 and ids.shape[1] + NEW > 16 + 112 + 50
    assert spec.tokens == plain.tokens
    assert spec.rejected_steps >= 20 and spec.accepted > 0 and max(spec.lengths) == 9


def test_assisted_generation_runs_over_the_default_cache(model):
    """transformers' assisted generation over the default cache: it runs, and the cache holds what was
    generated. Its tokens are not held to greedy decoding's: generate's first forward holds the prompt
    and the first drafts, which attend in full precision and take part in the key center's fit."""
    cache = TQCache(model.config)
    tokens = _generate(model, cache, prompt_lookup_num_tokens=8)
    assert len(tokens) == NEW
    assert cache.get_seq_length() == _prompt().shape[1] + NEW - 1  # (the last token is not yet fed)


def test_crop_keeps_the_older_tokens_exactly(model):
    """crop(-n) then n other tokens leaves what a cache that never held the dropped ones holds."""
    options = dict(fp16_window=0, key_center=False)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 60), generator=torch.Generator().manual_seed(2))
    a, b = TQCache(model.config, **options), TQCache(model.config, **options)
    model(ids[:, :40], past_key_values=a)
    model(ids[:, 40:50], past_key_values=a)
    a.crop(torch.tensor(-6))  # (transformers passes a tensor)
    model(ids[:, 44:60], past_key_values=a)
    model(ids[:, :40], past_key_values=b)
    model(ids[:, 40:60], past_key_values=b)
    assert a.get_seq_length() == b.get_seq_length() == 60
    for la, lb in zip(a.layers, b.layers):
        for x, y in zip(la.dequantize(), lb.dequantize()):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_crop_arguments(model):
    cache = TQCache(model.config)
    model(torch.arange(30)[None], past_key_values=cache)
    cache.crop(25)  # transformers' older convention: the length to keep
    assert cache.get_seq_length() == 25
    cache.crop(40)
    assert cache.get_seq_length() == 25
    cache.crop(0)
    assert cache.get_seq_length() == 25
    with pytest.raises(ValueError, match="tokens_to_remove: 26 is more than the 25 tokens held"):
        cache.crop(-26)
