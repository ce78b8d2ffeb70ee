#include "harness.h"
void test_cli(void) {}
