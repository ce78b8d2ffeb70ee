#include "harness.h"

void test_step(void) {}
