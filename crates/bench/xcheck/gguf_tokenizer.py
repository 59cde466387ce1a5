# Builds a Hugging Face fast tokenizer from a GGUF file's embedded BPE vocabulary, so the
# cross-check tool can size prompts offline.
import sys
from gguf import GGUFReader
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast

path, out = sys.argv[1], sys.argv[2]
r = GGUFReader(path)
def field(name):
    f = r.fields[name]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
def scalar(name):
    f = r.fields[name]
    return int(f.parts[f.data[0]][0])
tokens = field("tokenizer.ggml.tokens")
merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
vocab = {t: i for i, t in enumerate(tokens)}
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
])
tok.decoder = decoders.ByteLevel()
bos = tokens[scalar("tokenizer.ggml.bos_token_id")]
eos = tokens[scalar("tokenizer.ggml.eos_token_id")]
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
fast.save_pretrained(out)
print(len(tokens), "tokens; bos", bos, "eos", eos, "->", out)
print(fast(" the of and hello world")["input_ids"])
