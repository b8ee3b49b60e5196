"""Rollout wall-clock on a GPU with cuDNN attention on or off, 16 or 1 CPU threads, each in a fresh process:
`python docs/gpu_sdp_probe.py [training flags]` from the repo root (README "Performance")."""
import subprocess, sys

CODE = """
import sys, time, torch, ragen_mini as rm
cudnn, threads = int(sys.argv[1]), int(sys.argv[2])
cfg = rm.parse_args(sys.argv[3:])
dev = rm.pick_device("cuda")
torch.backends.cuda.enable_cudnn_sdp(bool(cudnn))  # after pick_device, which turns it off
torch.set_num_threads(threads)
model, tok = rm.load_policy(cfg, dev, quiet=True)
model.eval()
ts = []
for s in (100, 0, 1):  # new seeds each rollout, as in training: new sequence lengths
    torch.manual_seed(s); torch.cuda.synchronize(); t0 = time.perf_counter()
    rm.rollout(model, tok, cfg, [s * 1000 + g for g in range(cfg.groups)], cfg.group_size, 1.0)
    torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
print(f"cudnn_sdp={cudnn} threads={threads}: first rollout {ts[0]:.2f}s, then " + " ".join(f"{t:.2f}s" for t in ts[1:]), flush=True)
"""
for cudnn in (0, 1):
    for threads in (16, 1):
        try:
            subprocess.run([sys.executable, "-c", CODE, str(cudnn), str(threads)] + sys.argv[1:], timeout=60)
        except subprocess.TimeoutExpired:
            print(f"cudnn_sdp={cudnn} threads={threads}: over 60 s", flush=True)
