#!/usr/bin/env python3
"""batch-fit on a real PyTorch CPU loop, checked by hand.

    memtrack run --listen off --no-gpu --interval 100ms --memory-limit 2G \
        --name t --output runs -- PYTHON bench/batch_fit_torch.py 3 16 32 64
    memtrack advise runs/t
    # the truth: one size at a time under the same limit (exit 137 = killed)
    memtrack run --listen off --no-gpu --memory-limit 2G -- PYTHON bench/batch_fit_torch.py 2 B

PYTHON is an interpreter with torch (scripts/test's framework venv,
target/fw-venv/bin/python); `memtrack run` gives the job its client.
"""
import sys, torch, memtrack
torch.manual_seed(0)
torch.set_num_threads(1)
L, D = 1024, 128
model = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps = int(sys.argv[1])
for bs in map(int, sys.argv[2:]):
    for _ in range(steps):
        with memtrack.span("train", "step", labels={"batch_size": bs}):
            x = torch.randn(bs, L, D)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            del x, loss
print("done", flush=True)
