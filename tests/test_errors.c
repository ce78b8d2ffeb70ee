#include "harness.h"
void test_errors(void) {}
