/* attend.h with AVX2 and F16C. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,f16c")
#define ATTEND attend_avx2
#include "attend.h"
#endif
