import torch
from engine.quantization.fp8_linear import Fp8Linear
for m in (16, 255, 256, 257, 300, 512):
    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    b = torch.randn(512, device="cuda", generator=g).bfloat16()
    x = torch.randn(m, 256, device="cuda", generator=g).bfloat16()
    x[0] *= 1000.0
    dense = Fp8Linear.from_weight(w, b)
    layer = Fp8Linear(dense.weight, dense.weight_scale, b, dynamic="token")
    got = layer(x).float()
    cpu = Fp8Linear(dense.weight.cpu(), dense.weight_scale.cpu(), b.cpu().float(), dynamic="token")
    want = cpu(x.cpu().float(), out_dtype=torch.float32).cuda()
    # the same on the GPU in float32 (no cuBLASLt)
    xq, xs = layer.quantize_input(x)
    ref = (xq.float() * xs) @ layer.dequantized(torch.float32).t() + b.float()
    rows = want.abs().amax(dim=1, keepdim=True)
    rel = ((got - want).abs() / rows).amax(dim=1)
    rel_ref = ((ref - want).abs() / rows).amax(dim=1)
    bad = (rel > 2e-2).nonzero().flatten().tolist()
    print(f"m={m}: worst {rel.max():.4f} at row {int(rel.argmax())}, rows over 2%: {bad[:10]} "
          f"({len(bad)}); gpu-f32 ref vs cpu worst {rel_ref.max():.2e}")
    if bad:
        r = bad[0]
        print("   row", r, "got", got[r, :4].tolist(), "want", want[r, :4].tolist(),
              "scale", float(xs[r]) if xs.dim() else float(xs))
