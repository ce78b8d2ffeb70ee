#include "harness.h"

void test_layer_reference(void) {}
