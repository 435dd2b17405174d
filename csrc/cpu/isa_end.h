// Closes what isa_begin.h opened, then defines the stage's entry point, fill_<stage>_kernels in
// attention_ext::cpu::<isa> (declared in kernel_table.h), outside the target pragma: it only
// stores the stage's function pointers (the stage's static fill_stage) into a table.
#if !defined(ATTN_ISA_SKIP)
}  // namespace ATTN_ISA_NAMESPACE
}  // namespace cpu
}  // namespace attention_ext
#endif
#if defined(ATTN_ISA_PUSHED)
#pragma GCC pop_options
#endif

#if !defined(ATTN_ISA_SKIP)
#define ATTN_FILL_NAME_(stage) fill_##stage##_kernels
#define ATTN_FILL_NAME(stage) ATTN_FILL_NAME_(stage)
namespace attention_ext {
namespace cpu {
namespace ATTN_ISA_NAMESPACE {
void ATTN_FILL_NAME(ATTN_STAGE)(KernelTable& table) { fill_stage(table); }
}  // namespace ATTN_ISA_NAMESPACE
}  // namespace cpu
}  // namespace attention_ext
#endif
