"""Throwaway probe: CPU-side torch profile of one COAT layer step (what the host does before each launch)."""
import gc, os, sys, time, json
import torch
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_llama_layer as bl
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
dev = "cuda"
OUT = os.environ.get("OUT", "out")
_, layer = bl.make_layers(dev, 4, 2048, 4096, 11008, 32)
coat = bl.CoatLlamaLayer(layer)
params = list(layer.parameters())
x = torch.randn(4, 2048, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
def step(sleep):
    for p in params: p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    if sleep: torch.cuda._sleep(400_000_000)
    with torch.profiler.record_function("STEP"):
        coat(x).backward(dy)
    torch.cuda.synchronize()
gc.disable()
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(3): step(False)
    for sleep in (False, True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(sleep); step(sleep)
        path = os.path.join(OUT, f"cpu_trace_sleep{int(sleep)}.json")
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
        steps = sorted([e for e in ev if e["name"] == "STEP"], key=lambda e: e["ts"])
        s = steps[-1]; t0, t1 = s["ts"], s["ts"] + s["dur"]
        cpu = sorted([e for e in ev if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation") and t0 <= e["ts"] <= t1 and e.get("tid") == s.get("tid")], key=lambda e: e["ts"])
        print(f"sleep={sleep}: main-thread CPU events of the last step, first 1.2 ms (start us, dur us, name):")
        for e in cpu:
            if e["ts"] - t0 > 1200: break
            if e["dur"] >= 3 or "Launch" in e["name"]:
                print(f"  {e['ts'] - t0:8.1f} {e['dur']:7.1f}  {e['cat'][:8]:8s} {e['name'][:90]}")
        sm = [e for e in cpu if e["name"] == "aten::_scaled_mm"]
        for m in sm[:2]:
            kids = [e for e in ev if e.get("tid") == m.get("tid") and m["ts"] <= e["ts"] <= m["ts"] + m["dur"] and e is not m]
            print(f"  _scaled_mm at {m['ts']-t0:.1f} dur {m['dur']:.1f}: " + "; ".join(f"{k['name'][:40]} {k['dur']:.1f}" for k in kids))
