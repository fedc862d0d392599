"""Where the time of one LAVO op forward + backward goes, by PyTorch operator.
Usage: python benchmarks/profile_lavo.py [--length 16384] [--threads 2]"""
import argparse

import torch
from torch.profiler import profile

from lavo.ops import lavo_attention, orthogonal_basis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, head_dim, rank, window = 8, 64, 64, 128
    q, k, v = (torch.randn(1, args.length, heads, head_dim, requires_grad=True) for _ in range(3))
    basis = orthogonal_basis(heads, rank, head_dim)
    pos_bias = torch.zeros(heads, 2 * window, requires_grad=True)

    def step():
        lavo_attention(q, k, v, basis, window=window, pos_bias=pos_bias).backward(torch.ones(q.shape))

    step()  # warm-up
    with profile() as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
