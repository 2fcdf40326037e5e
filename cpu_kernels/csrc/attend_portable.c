/* attend.h for any CPU: the build's own target (SSE2 on x86-64). */
#define ATTEND attend_portable
#include "attend.h"
