"""Main job: train a small character-level transformer LM with CoatFP8AdamW and with torch.optim.AdamW from the
same initialisation, and print both loss curves and the optimizer-state memory of each.

Runs on the CPU with the small embedded default (the torch reference path of CoatFP8AdamW); on a GPU it uses the
fused Triton kernel. Usage: python -m launch.compare_optimizers [--steps 300] [--device cuda] [--width 128]
"""
import argparse
import copy
import time

import torch

from coat_ds import CoatFP8AdamW

TEXT = (
    "COAT compresses optimizer states and activations for memory-efficient FP8 training. The two AdamW moments "
    "are stored in FP8 with one scale per group of 128 values; dynamic range expansion raises each group to a "
    "power k before quantization so that its values fill the narrow range of the FP8 format, and the inverse "
    "power restores them after dequantization. Activations saved for backward are kept in FP8 as well: per "
    "tensor for the inputs of matrix multiplications, and in groups of sixteen for the inputs of non-linear "
    "layers such as normalization and the SwiGLU activation. Training stays nearly lossless while memory drops. "
) * 4


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, width, layers, heads, context):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True, activation="gelu")
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        return self.head(self.blocks(self.embed(tokens) + self.pos[:n], mask=mask, is_causal=True))


def batches(data, batch, context, steps, seed, device):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        chunk = torch.stack([data[i:i + context + 1] for i in idx]).to(device)
        yield chunk[:, :-1], chunk[:, 1:]


def train(model, opt, data, args):
    losses, start = [], time.perf_counter()
    for x, y in batches(data, args.batch, args.context, args.steps, args.seed, args.device):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    vocab = sorted(set(TEXT))
    data = torch.tensor([vocab.index(c) for c in TEXT])
    torch.manual_seed(args.seed)
    base = TinyLM(len(vocab), args.width, args.layers, 4, args.context).to(args.device)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"device {args.device}, {n_params / 1e3:.0f}k parameters, {args.steps} steps of {args.batch}x{args.context} "
          f"tokens")
    runs = {}
    for name, make in (("torch AdamW", lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.01)),
                       ("CoatFP8AdamW", lambda ps: CoatFP8AdamW(ps, lr=args.lr, weight_decay=0.01))):
        model = copy.deepcopy(base)
        opt = make(model.parameters())
        losses, seconds = train(model, opt, data, args)
        runs[name] = losses
        print(f"{name:<13} final loss {sum(losses[-10:]) / 10:.4f}  optimizer state {state_bytes(opt) / 2**20:.3f} MiB "
              f"({state_bytes(opt) / n_params:.2f} bytes/param)  {seconds:.1f} s")
    print("\nloss curve (mean of each tenth of training)")
    print(f"{'steps':>11} " + " ".join(f"{name:>13}" for name in runs))
    tenth = max(1, args.steps // 10)
    for i in range(0, args.steps, tenth):
        print(f"{i:>5}-{min(i + tenth, args.steps):<5} " +
              " ".join(f"{sum(l[i:i + tenth]) / len(l[i:i + tenth]):13.4f}" for l in runs.values()))


if __name__ == "__main__":
    main()
