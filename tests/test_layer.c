#include "harness.h"

void test_layer(void) {}
