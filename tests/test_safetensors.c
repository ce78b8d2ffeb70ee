#include "harness.h"
void test_safetensors(void) {}
