module @jit_s0_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<4x8xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[3]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.reshape %arg0 : (tensor<16x8xf32>) -> tensor<4x4x8xf32>
    %1 = stablehlo.slice %0 [0:1, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %2 = stablehlo.reshape %1 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %3 = stablehlo.slice %0 [1:2, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %4 = stablehlo.reshape %3 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %5 = stablehlo.slice %0 [2:3, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %6 = stablehlo.reshape %5 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %7 = stablehlo.slice %0 [3:4, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %8 = stablehlo.reshape %7 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    return %2, %4, %6, %8 : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>
  }
}
