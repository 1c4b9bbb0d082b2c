"""HLO text parsing on a handwritten scheduled GPU-style module (no GPU needed)."""

import pathlib

from acco_jax.analysis import hlo, kernels

TEXT = (pathlib.Path(__file__).parent / "data" / "gpu_schedule.hlo").read_text()


def test_async_pairs_and_loop_bracketing():
  pairs = {p.kind: p for p in hlo.async_overlap_report(TEXT)}
  assert set(pairs) == {"reduce-scatter", "all-gather", "all-reduce"}
  rs, ag, ar = pairs["reduce-scatter"], pairs["all-gather"], pairs["all-reduce"]
  assert rs.brackets_loop and not rs.is_sync
  assert ag.brackets_loop and ag.is_sync  # marked synchronous: it would not overlap
  assert not ar.brackets_loop  # started and finished before the loop
  assert rs.start < rs.done and ag.start < ag.done


def test_collectives_bytes_and_loop_membership():
  found = hlo.hlo_collectives(TEXT)
  kinds = sorted(c.kind for c in found)
  assert kinds == ["all-gather", "all-reduce", "reduce-scatter"]  # async shells counted once
  by_kind = {}
  for c in found:
    by_kind.setdefault(c.kind, []).append(c)
  # the wrapped reduce-scatter: bf16[8] result x 8 devices = 128 bytes of input
  assert by_kind["reduce-scatter"][0].bytes == 128
  assert by_kind["all-gather"][0].bytes == 128  # the start's (operand, result) tuple: the result
  assert by_kind["all-reduce"][0].bytes == 128
  assert not any(c.in_loop for c in found)


def test_loop_body_collectives_are_flagged():
  text = TEXT.replace(
    "  ROOT %t = (s32[], f32[4]{0}) tuple(%next, %v)",
    "  %bad = f32[4]{0} all-reduce(%v), channel_id=9, replica_groups={{0,1}}, to_apply=%add\n"
    "  ROOT %t = (s32[], f32[4]{0}) tuple(%next, %bad)",
  )
  inside = [c for c in hlo.hlo_collectives(text) if c.in_loop]
  assert len(inside) == 1 and inside[0].kind == "all-reduce"


def test_parse_finds_entry():
  comps, entry = hlo.parse_hlo(TEXT)
  assert entry == "main.1_spmd"
  assert [i.opcode for i in comps["cond"]][-1] == "compare"


GEMM_TEXT = """HloModule m, entry_computation_layout={()->f32[]}

%gemm_fusion_dot.1_computation (parameter_0: bf16[128,64], parameter_1: bf16[1024,64]) -> bf16[128,1024] {
  %parameter_0 = bf16[128,64]{1,0} parameter(0)
  %parameter_1 = bf16[1024,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[128,1024]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/bld,vd->blv/dot_general"}
}

ENTRY %main.2 (a: bf16[128,64], w: bf16[1024,64], g: f32[128,1024]) -> f32[1024,64] {
  %a = bf16[128,64]{1,0} parameter(0)
  %w = bf16[1024,64]{1,0} parameter(1)
  %g = f32[128,1024]{1,0} parameter(2)
  %f = bf16[128,1024]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %c = f32[1024,64]{1,0} convert(%w)
  ROOT %cc = (f32[1024,64]{1,0}, s8[0]{0}) custom-call(%g, %c), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/transpose(bld,vd->blv)/dot_general"}
}
"""


def test_gemms_read_operand_dtypes_inside_fusions_and_custom_calls():
  found = {g.name: g for g in kernels.gemms(GEMM_TEXT)}
  assert set(found) == {"dot.1", "cc"}
  dot, cublas = found["dot.1"], found["cc"]
  assert dot.kind == "dot" and dot.operands == ("bf16[128,64]", "bf16[1024,64]")
  assert dot.computation == "gemm_fusion_dot.1_computation" and "bld,vd->blv" in dot.op_name
  assert cublas.kind == "__cublas$gemm" and cublas.dtypes == ("f32", "f32")
  assert cublas.result == "f32[1024,64]"


FUSION_TEXT = """HloModule m, entry_computation_layout={()->f32[]}

%fused_slice (p0: f32[64,16], p1: f32[16]) -> f32[4,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %s = f32[4,16]{1,0} slice(%p0), slice={[0:4], [0:16]}
  %b = f32[4,16]{1,0} broadcast(%p1), dimensions={1}
  ROOT %m = f32[4,16]{1,0} multiply(%s, %b)
}

%fused_whole (q0: bf16[8,32]) -> f32[8,32] {
  %q0 = bf16[8,32]{1,0} parameter(0)
  ROOT %c = f32[8,32]{1,0} convert(%q0)
}

%body (t: (s32[], f32[64,16], f32[16])) -> (s32[], f32[64,16], f32[16]) {
  %t = (s32[], f32[64,16]{1,0}, f32[16]{0}) parameter(0)
  %x = f32[64,16]{1,0} get-tuple-element(%t), index=1
  %v = f32[16]{0} get-tuple-element(%t), index=2
  %f = f32[4,16]{1,0} fusion(%x, %v), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(f)/mul"}
  ROOT %r = (s32[], f32[64,16]{1,0}, f32[16]{0}) tuple(%t, %x, %v)
}

%cond (t: (s32[], f32[64,16], f32[16])) -> pred[] {
  %t = (s32[], f32[64,16]{1,0}, f32[16]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main.3 (a: f32[64,16], v: f32[16], h: bf16[8,32]) -> f32[8,32] {
  %a = f32[64,16]{1,0} parameter(0)
  %v = f32[16]{0} parameter(1)
  %h = bf16[8,32]{1,0} parameter(2)
  %init = (s32[], f32[64,16]{1,0}, f32[16]{0}) tuple(%a, %a, %v)
  %w = (s32[], f32[64,16]{1,0}, f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %g = f32[8,32]{1,0} fusion(%h), kind=kLoop, calls=%fused_whole
}
"""


def test_fusion_traffic_counts_what_each_fusion_moves_and_its_runs():
  found = {f.name: f for f in kernels.fusion_traffic(FUSION_TEXT)}
  assert set(found) == {"f", "g"}
  # in the loop: runs 6 times; reads 4 of p0's 64 rows (a slice) and all of p1, writes 4 x 16
  f = found["f"]
  assert f.runs == 6 and f.op_name == "jit(f)/mul" and f.kind == "kLoop"
  assert f.bytes == 4 * 16 * 4 + 16 * 4 + 4 * 16 * 4
  # the entry's convert: reads the bf16 input whole and writes it in f32, once
  assert found["g"].runs == 1 and found["g"].bytes == 8 * 32 * 2 + 8 * 32 * 4
  # a loop whose trip count XLA does not know counts as many runs as the caller says
  unknown = FUSION_TEXT.replace(', backend_config={"known_trip_count":{"n":"6"}}', "")
  assert {f.name: f.runs for f in kernels.fusion_traffic(unknown, unknown_trips=3)}["f"] == 3
