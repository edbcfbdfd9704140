module @jit_s0_bwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg4: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg5: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<8x8xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.add %arg0, %arg1 : tensor<4x8xf32>
    %1 = stablehlo.add %0, %arg2 : tensor<4x8xf32>
    %2 = stablehlo.multiply %1, %arg3 : tensor<4x8xf32>
    %3 = stablehlo.multiply %2, %arg4 : tensor<4x8xf32>
    %4 = stablehlo.add %2, %3 : tensor<4x8xf32>
    %5 = stablehlo.dot_general %4, %arg5, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
    %6 = stablehlo.transpose %5, dims = [1, 0] : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %6 : tensor<8x8xf32>
  }
}
