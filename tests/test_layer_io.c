#include "harness.h"

void test_layer_io(void) {}
